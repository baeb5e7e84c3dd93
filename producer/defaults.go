package producer

// #include "defaults.h"
import "C"

// Defaults of Options, from defaults.h, which the C ABI's
// tsock_producer_options_init writes too.
const (
	DefaultSlots      = C.TSOCK_DEFAULT_SLOT_COUNT
	DefaultSlotBytes  = C.TSOCK_DEFAULT_SLOT_BYTES
	DefaultMaxReaders = C.TSOCK_DEFAULT_MAX_READERS
	DefaultMode       = C.TSOCK_DEFAULT_MODE
)

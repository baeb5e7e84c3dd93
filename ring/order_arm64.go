package ring

import (
	"sync/atomic"

	"github.com/tsock/tsock/ring/internal/barrier"
)

// beginSlot zeroes a slot's seqlock stamp so that no later store becomes
// visible before the 0. Go's atomic store is STLR on arm64, a release
// store: it orders the accesses before it, not the stores after it, which
// may become visible first (a reader would then copy new descriptors and
// still see the old stamp: a torn batch taken for whole). Go has no
// fence, and its Swap and CompareAndSwap are not one either where the CPU
// lacks LSE atomics (an LDAXR/STLXR loop, no DMB). Hence the explicit
// store-store barrier (DMB ISHST, ring/internal/barrier): the writer's
// half of the message-passing pattern whose other half is the reader's
// acquire fence before it re-reads the stamp.
func beginSlot(stamp *uint64) {
	atomic.StoreUint64(stamp, 0)
	barrier.StoreStore()
}

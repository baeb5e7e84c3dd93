//go:build amd64 || 386 || s390x

package ring

import "sync/atomic"

// beginSlot zeroes a slot's seqlock stamp so that no later store becomes
// visible before the 0. These architectures order stores (x86-TSO, and
// z/Architecture): the hardware never makes a store visible before an
// earlier one, and Go's compiler keeps the stores after an atomic store
// after it. The atomic store alone is enough, and costs nothing more.
func beginSlot(stamp *uint64) { atomic.StoreUint64(stamp, 0) }

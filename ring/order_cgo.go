//go:build !(amd64 || 386 || s390x || arm64)

package ring

/*
#cgo noescape ring_begin_slot
#cgo nocallback ring_begin_slot
#include <stdint.h>

// The C11 seqlock writer's opening (Boehm, "Can seqlocks get along with
// programming language memory models?"): the stamp, then a release fence,
// which orders it before every later store. The C compiler emits the
// barrier each architecture needs (lwsync on ppc64, fence rw,w on riscv64,
// dbar on loong64, sync on mips, dmb on arm).
static inline void ring_begin_slot(uint64_t *stamp) {
	__atomic_store_n(stamp, 0, __ATOMIC_RELAXED);
	__atomic_thread_fence(__ATOMIC_RELEASE);
}
*/
import "C"

import "unsafe"

// beginSlot zeroes a slot's seqlock stamp so that no later store becomes
// visible before the 0. On these weakly ordered architectures Go offers
// no fence (and its atomic store is a release store at best, which orders
// only what precedes it), so the store and a C11 release fence are made in
// C: one cgo call per batch.
func beginSlot(stamp *uint64) {
	C.ring_begin_slot((*C.uint64_t)(unsafe.Pointer(stamp)))
}

package producer

import (
	"os"

	"github.com/tsock/tsock/internal/readers"
)

// ForkGuard keeps the descriptors that carry liveness locks out of
// children forked without exec. A Go program cannot fork without exec; a C
// or Python program that loads libtsock.so can, and does (DataLoader
// workers): the C ABI installs a guard whose fork handler closes them in
// the child. Open runs open, which makes one descriptor, so that no fork()
// can copy it before the guard knows it; Close closes one the same way.
type ForkGuard interface {
	Open(open func() (*os.File, error)) (*os.File, error)
	Close(f *os.File) error
}

var forkGuard ForkGuard

// SetForkGuard installs g; call it once, before any producer is created.
func SetForkGuard(g ForkGuard) { forkGuard = g }

// openLockable opens a descriptor that holds, or may come to hold, an OFD
// lock, under the fork guard if there is one.
func openLockable(open func() (*os.File, error)) (*os.File, error) {
	if forkGuard == nil {
		return open()
	}
	return forkGuard.Open(open)
}

// closeLockable closes a descriptor opened with openLockable.
func closeLockable(f *os.File) error {
	if forkGuard == nil {
		return f.Close()
	}
	return forkGuard.Close(f)
}

// guard is the fork guard the reader table uses for the join socket, the
// readers' connections and their records' memfds.
func guard() readers.Guard {
	if forkGuard == nil {
		return readers.NoGuard{}
	}
	return forkGuard
}

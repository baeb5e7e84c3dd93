package ring

// The Linux primitives of the Go side: futexes on shared words, OFD byte
// locks, process start times (and Reopen, segment.go). Their C twins, for
// libtsock_reader.so, which has no Go runtime to call these, are in
// reader/platform.c; both follow one contract (reader/internal.h says
// where it is written): change a twin together with its other half.

import (
	"errors"
	"os"
	"strconv"
	"strings"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// FutexWait sleeps while *word == expected, at most timeout (negative: no
// limit). Spurious and early returns are normal: callers look again.
func FutexWait(word *uint32, expected uint32, timeout time.Duration) {
	var ts *unix.Timespec
	if timeout >= 0 {
		t := unix.NsecToTimespec(int64(timeout))
		ts = &t
	}
	// FUTEX_WAIT without FUTEX_PRIVATE_FLAG: the word is in a shared file
	// mapping seen by other processes.
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(word)), 0, /* FUTEX_WAIT */
		uintptr(expected), uintptr(unsafe.Pointer(ts)), 0, 0)
}

// FutexWakeAll wakes every process sleeping on word.
func FutexWakeAll(word *uint32) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(word)), 1, /* FUTEX_WAKE */
		uintptr(1<<31-1), 0, 0, 0)
}

func byteLock(typ int16, b int64) unix.Flock_t {
	return unix.Flock_t{Type: typ, Whence: 0, Start: b, Len: 1}
}

// ErrLocked says another open file description holds the lock.
var ErrLocked = errors.New("byte is locked by another holder")

// LockByte takes an OFD write lock on one byte of f without waiting. The
// kernel drops it when the last descriptor of this open file description
// closes, i.e. when the process dies.
func LockByte(f *os.File, b int64) error {
	fl := byteLock(unix.F_WRLCK, b)
	err := unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &fl)
	if err == unix.EAGAIN || err == unix.EACCES {
		return ErrLocked
	}
	return err
}

// UnlockByte drops an OFD lock taken with LockByte.
func UnlockByte(f *os.File, b int64) error {
	fl := byteLock(unix.F_UNLCK, b)
	return unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &fl)
}

// ByteLocked reports whether another open file description holds a lock on
// byte b of f.
func ByteLocked(f *os.File, b int64) (bool, error) {
	fl := byteLock(unix.F_WRLCK, b)
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &fl); err != nil {
		return false, err
	}
	return fl.Type != unix.F_UNLCK, nil
}

// ByteWriteLocked reports whether another open file description holds a
// write lock on byte b of f. Only a process that may write the file can
// take one; anyone who may read it can take a read lock, which this
// ignores: the producer's liveness is its write lock, and a reader's read
// lock there must not make a dead producer look alive.
func ByteWriteLocked(f *os.File, b int64) (bool, error) {
	fl := byteLock(unix.F_WRLCK, b)
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &fl); err != nil {
		return false, err
	}
	// With a write lock held no read lock can be: if any lock is
	// reported, it is the write lock.
	return fl.Type == unix.F_WRLCK, nil
}

// RangeLocked reports whether another open file description holds a lock
// on any byte of f in [start, start+length); length 0 means to the end of
// the file and beyond. One system call, whatever the range.
func RangeLocked(f *os.File, start, length int64) (bool, error) {
	fl := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: start, Len: length}
	if err := unix.FcntlFlock(f.Fd(), unix.F_OFD_GETLK, &fl); err != nil {
		return false, err
	}
	return fl.Type != unix.F_UNLCK, nil
}

// ProcStartTime is field 22 of /proc/<pid>/stat (clock ticks since boot);
// with the pid it identifies a process even after the pid is reused. 0 if
// unknown.
func ProcStartTime(pid int) uint64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:]) // f[0] is field 3
	if len(f) < 20 {
		return 0
	}
	v, err := strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0
	}
	return v
}

// MonotonicNs is CLOCK_MONOTONIC in nanoseconds, the clock the C reader
// uses for publish_ns and heartbeats. It reads the clock through the Go
// runtime's vDSO path (tens of nanoseconds) rather than a system call
// (hundreds), because the producer stamps every batch with it.
func MonotonicNs() uint64 { return uint64(nanotime()) }

//go:linkname nanotime runtime.nanotime
func nanotime() int64

// ChannelPath is the segment file of a channel.
func ChannelPath(name string) string { return ShmDir + "/" + ShmPrefix + name }

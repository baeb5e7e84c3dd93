package readers

import (
	"errors"

	"golang.org/x/sys/unix"
)

// Descriptors a peer sent, and connections that may still hold some, are
// closed without anything waiting for them: close() of a descriptor that
// a peer made can block for as long as that peer likes (a TCP socket with
// SO_LINGER and unsent data, a Unix socket with such a socket queued in
// it, a file of a FUSE mount). The producer never closes one under the
// fork guard's hold, nor on a goroutine that Close waits for
// (docs/ARCHITECTURE.md, "Threat model").

// maxRights is the most descriptors one message can carry (the kernel's
// SCM_MAX_FD): a control buffer this large receives all of them, so none
// is dropped by the kernel, which would close it in the receiving thread.
const maxRights = 253

// rightsSpace is the size of a control buffer that holds every descriptor
// a message can carry.
var rightsSpace = unix.CmsgSpace(4 * maxRights)

// discardWorkers close what discard is given, one descriptor at a time
// each: a descriptor whose close blocks holds one worker (and its thread),
// never the producer, and at most this many threads are ever held.
const discardWorkers = 2

var discards = make(chan int, 4096)

// discardHook, when set (tests), is given the descriptors instead.
var discardHook func(fds []int)

func init() {
	for range discardWorkers {
		go func() {
			for fd := range discards {
				unix.Close(fd)
			}
		}()
	}
}

// discard closes descriptors a peer sent, later, on the discard workers.
// It never blocks: beyond the queue's room, a goroutine waits to hand
// the descriptor over (a goroutine, not a thread).
func discard(fds ...int) {
	if discardHook != nil {
		discardHook(fds)
		return
	}
	for _, fd := range fds {
		select {
		case discards <- fd:
		default:
			go func() { discards <- fd }()
		}
	}
}

// recvRights receives one message on the non-blocking socket fd into buf,
// with every descriptor it carries (close-on-exec). A message that carried
// more than the control buffer holds is reported as truncated.
func recvRights(fd int, buf []byte) (n int, fds []int, truncated bool, err error) {
	oob := make([]byte, rightsSpace)
	n, oobn, flags, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
	if err != nil {
		return 0, nil, false, err
	}
	return n, rights(oob[:oobn]), flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0, nil
}

// drainRights takes the queue of a connection the producer is about to
// close: shut down first (no message can be queued after that: the
// peer's send fails with EPIPE), every message still queued is received
// and the descriptors in them are discarded. Closing the connection then
// drops none (dropped, they would be closed by the kernel in the thread
// that closes it). It reports whether the queue was seen empty.
//
// A shut-down socket answers an empty queue with 0 bytes, as it does a
// message of 0 bytes (which a peer can send): with SO_PASSCRED, every
// message comes with its sender's credentials, and the end of the queue
// with none.
func drainRights(fd int) bool {
	_ = unix.Shutdown(fd, unix.SHUT_RDWR)
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSCRED, 1) != nil {
		return false
	}
	buf := make([]byte, 64)
	oob := make([]byte, unix.CmsgSpace(unix.SizeofUcred)+rightsSpace)
	for range maxDrained {
		n, oobn, _, _, err := unix.Recvmsg(fd, buf, oob, unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return false
		case n == 0 && oobn == 0:
			return true
		}
		discard(rights(oob[:oobn])...)
	}
	return false
}

// maxDrained bounds drainRights, which should never meet it (a queue holds
// far fewer messages): a connection that still has messages then is closed
// as a peer's descriptor is.
const maxDrained = 1 << 16

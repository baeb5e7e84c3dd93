package readers

import (
	"errors"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Descriptors a peer sent, and connections that may still hold some, are
// closed without anything waiting for them: close() of a descriptor that
// a peer made can block for as long as that peer likes (a TCP socket with
// SO_LINGER and unsent data, a Unix socket with such a socket queued in
// it, a file of a FUSE mount). The producer never closes one under the
// fork guard's hold, nor on a goroutine that Close waits for
// (docs/ARCHITECTURE.md, "Threat model").
//
// What a peer can make the producer hold is bounded: the descriptors
// received and not yet closed count against fdBudget. A message whose
// descriptors do not fit is left in its connection, unread, and the
// connection is given up whole (one descriptor, closed like the others:
// see handOver); past fdBudget+fdOverdraft, the producer accepts no new
// connection until the discard workers catch up. Joins go on meanwhile:
// a request's one descriptor of this segment is always taken (its close
// cannot block).

// maxRights is the most descriptors one message can carry (the kernel's
// SCM_MAX_FD): a control buffer this large receives all of them, so none
// is dropped by the kernel, which would close it in the receiving thread.
const maxRights = 253

// rightsSpace is the size of a control buffer that holds every descriptor
// a message can carry, and the sender's credentials (drainRights asks for
// them).
var (
	credSpace   = unix.CmsgSpace(unix.SizeofUcred)
	rightsSpace = unix.CmsgSpace(4*maxRights) + credSpace
)

// fdBudget bounds the descriptors peers sent that the producer holds
// (received, waiting for a discard worker): a quarter of the descriptor
// limit, at most 512. fdOverdraft more may be connections given up whole
// while the budget is spent; beyond both, no connection is accepted.
var fdBudget = budgetFor(unix.RLIMIT_NOFILE)

const fdOverdraft = 128

func budgetFor(resource int) int64 {
	var lim unix.Rlimit
	if unix.Getrlimit(resource, &lim) != nil || lim.Cur/4 > 512 {
		return 512
	}
	return int64(lim.Cur / 4)
}

// held counts the peers' descriptors the producer holds now (received or
// handed over, not yet closed).
var held atomic.Int64

// reserve takes n from the budget, or reports false if n do not fit.
func reserve(n int64) bool {
	for {
		h := held.Load()
		if h+n > fdBudget {
			return false
		}
		if held.CompareAndSwap(h, h+n) {
			return true
		}
	}
}

// overdrawn reports whether the producer should accept no connection.
func overdrawn() bool { return held.Load() >= fdBudget+fdOverdraft }

// errOverBudget is a message left in its connection: it carries more
// descriptors than the budget has room for.
var errOverBudget = errors.New("the peer's descriptors do not fit the producer's budget")

// discardWorkers close what discard is given, one descriptor at a time
// each: a descriptor whose close blocks holds one worker (and its thread),
// never the producer, and at most this many threads are ever held.
const discardWorkers = 2

var discards = make(chan int, 4096)

// discardHook, when set (tests), is given the descriptors instead; they
// stay counted in held (as if every worker were stuck).
var discardHook func(fds []int)

func init() {
	for range discardWorkers {
		go func() {
			for fd := range discards {
				unix.Close(fd)
				held.Add(-1)
			}
		}()
	}
}

// discard closes descriptors counted in held later, on the discard
// workers. It never blocks: beyond the queue's room (which the budget
// keeps it from reaching), a goroutine waits to hand one over.
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

// closeTrusted closes a received descriptor whose close cannot block
// (this segment's own file).
func closeTrusted(fd int) {
	unix.Close(fd)
	held.Add(-1)
}

// handOver gives up a connection (or the listener) that may still queue a
// peer's descriptors: a duplicate goes to the discard workers (the caller
// then closes its own, which is not the last reference). With no
// descriptor free for the duplicate, the spare's number is used. It
// reports false when neither worked: the caller must then keep f open.
func handOver(f *os.File) bool {
	fd := rawFd(f)
	if fd < 0 {
		return true // already closed
	}
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		d, err = dupToSpare(fd)
	} else {
		ensureSpare()
	}
	if err != nil {
		return false
	}
	held.Add(1)
	discard(d)
	return true
}

// spare is a descriptor of /dev/null kept open so that handOver can
// duplicate a connection even when the process has no descriptor free
// (dup3 onto a number it owns needs none); another is opened after each
// use.
var (
	spareMu sync.Mutex
	spare   = openSpare()
)

func openSpare() int {
	fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1
	}
	return fd
}

// ensureSpare opens a spare again after one was used.
func ensureSpare() {
	spareMu.Lock()
	defer spareMu.Unlock()
	if spare < 0 {
		spare = openSpare()
	}
}

func dupToSpare(fd int) (int, error) {
	spareMu.Lock()
	defer spareMu.Unlock()
	if spare < 0 {
		return -1, unix.EMFILE
	}
	if err := unix.Dup3(fd, spare, unix.O_CLOEXEC); err != nil {
		return -1, err
	}
	d := spare
	spare = openSpare()
	return d, nil
}

// stranded keeps open, for the life of the process, connections that
// could be neither drained nor handed over (no descriptor free, spare
// used): closing them here could block.
var (
	strandedMu sync.Mutex
	stranded   []*os.File
)

func strand(f *os.File) {
	strandedMu.Lock()
	stranded = append(stranded, f)
	strandedMu.Unlock()
}

// message is one message received from a peer.
type message struct {
	n         int   // bytes
	fds       []int // descriptors it carried, counted in held
	truncated bool  // it did not fit buf, or its control data did not fit
	ctrunc    bool  // its control data did not fit (or its descriptors could not be installed)
	withCred  bool  // it came with the sender's credentials (SO_PASSCRED)
}

// recvPeer receives one message from the peer's non-blocking socket fd
// into buf, with every descriptor it carries (close-on-exec), counted in
// held: the caller discards each, or closes one it trusted at once
// (closeTrusted).
//
// While the budget has room for a full message, the message is taken as
// it is. Otherwise it is looked at first (MSG_PEEK): one with no
// descriptor is taken; one with a single descriptor that trusted accepts
// (nil: none) is taken beyond the budget; any other is left queued and
// errOverBudget returned. The look installs a copy of the first
// descriptor while the budget has room for it (counted, and discarded:
// close() of any copy may wait, a FUSE file's flush), and none once it has
// not (the kernel then drops its copies with fput, which waits for
// nothing while the queued message holds the files).
func recvPeer(fd int, buf []byte, trusted func(fd int) bool) (message, error) {
	if reserve(maxRights) {
		m, err := recvmsg(fd, buf, rightsSpace, 0)
		held.Add(int64(len(m.fds)) - maxRights)
		return m, err
	}
	// The control buffers are sized exactly: the kernel installs as many
	// descriptors as fit, after the credentials when they are asked for.
	creds := 0
	if on, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_PASSCRED); err == nil && on != 0 {
		creds = credSpace
	}
	oneSpace := creds + unix.CmsgSpace(4)
	lookSpace, counted := creds, reserve(1)
	if counted {
		lookSpace = oneSpace
	}
	peek, err := recvmsg(fd, buf, lookSpace, unix.MSG_PEEK)
	if counted {
		held.Add(int64(len(peek.fds)) - 1)
	}
	if err != nil {
		return message{}, err
	}
	switch {
	case !peek.ctrunc && len(peek.fds) == 0:
		return recvmsg(fd, buf, creds, 0) // no descriptor: nothing can be dropped
	case !peek.ctrunc && len(peek.fds) == 1 && trusted != nil && trusted(peek.fds[0]):
		closeTrusted(peek.fds[0])
		held.Add(1)
		m, err := recvmsg(fd, buf, oneSpace, 0)
		held.Add(int64(len(m.fds)) - 1)
		return m, err
	}
	discard(peek.fds...)
	return message{}, errOverBudget
}

func recvmsg(fd int, buf []byte, oobSpace, flags int) (message, error) {
	var oob []byte
	if oobSpace > 0 {
		oob = make([]byte, oobSpace)
	}
	n, oobn, rflags, _, err := unix.Recvmsg(fd, buf, oob, flags|unix.MSG_CMSG_CLOEXEC|unix.MSG_DONTWAIT)
	if err != nil {
		return message{}, err
	}
	fds, cred := control(oob[:oobn])
	return message{n: n, fds: fds, truncated: rflags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0,
		ctrunc: rflags&unix.MSG_CTRUNC != 0, withCred: cred}, nil
}

// control parses a message's control data: the descriptors it carried,
// and whether it had the sender's credentials.
func control(oob []byte) (fds []int, cred bool) {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil, false
	}
	for _, m := range msgs {
		switch {
		case m.Header.Level == unix.SOL_SOCKET && m.Header.Type == unix.SCM_RIGHTS:
			if r, err := unix.ParseUnixRights(&m); err == nil {
				fds = append(fds, r...)
			}
		case m.Header.Level == unix.SOL_SOCKET && m.Header.Type == unix.SCM_CREDENTIALS:
			cred = true
		}
	}
	return fds, cred
}

// drainRights takes the queue of a connection the producer is about to
// close: shut down first (no message can be queued after that: the
// peer's send fails with EPIPE), every message still queued is received
// and the descriptors in them are discarded. Closing the connection then
// drops none (dropped, they would be closed by the kernel in the thread
// that closes it). It reports whether the queue was seen empty; a queue
// the budget cannot take is not (the connection is then handed over).
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
	for range maxDrained {
		m, err := recvPeer(fd, buf, nil)
		switch {
		case errors.Is(err, unix.EINTR):
			continue
		case err != nil:
			return false
		case m.n == 0 && !m.withCred && len(m.fds) == 0:
			return true
		}
		discard(m.fds...)
	}
	return false
}

// maxDrained bounds drainRights, which should never meet it (a queue holds
// far fewer messages): a connection that still has messages then is
// handed over.
const maxDrained = 1 << 16

package readers

import (
	"errors"
	"os"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"
)

// Descriptors a peer sent, and sockets a peer can reach, are closed
// where nothing waits for them: close() of a descriptor that a peer made
// can block for as long as that peer likes (a TCP socket with SO_LINGER
// and unsent data, a Unix socket with such a socket queued in it, a file
// of a FUSE mount, whose flush runs on every close), and so can the close
// of a connection or listener that still queues one (the kernel releases
// what is queued in the closing thread; kernels before 6.8 may also run
// the Unix socket garbage collector there). The producer never closes one
// under the fork guard's hold, nor on a goroutine that Close waits for
// (docs/ARCHITECTURE.md, "Descriptors peers send").
//
// It takes no descriptor from a peer but a join request's one, and only
// once a copy has shown it to be this segment's file; a message that
// carries any other is never received. Every connection, and the
// listener, is shut down and handed over whole (handOver): a duplicate
// goes to the discard workers, whose close releases whatever is queued.
// What it holds for peers (copies, handed-over sockets) is counted in
// held; past fdBudget, it accepts no connection until the discard workers
// catch up.

// fdBudget is how many descriptors the producer holds for peers before it
// stops accepting connections: a quarter of the descriptor limit as it is
// now, at most 512.
func fdBudget() int64 {
	var lim unix.Rlimit
	if unix.Getrlimit(unix.RLIMIT_NOFILE, &lim) != nil || lim.Cur/4 > 512 {
		return 512
	}
	return max(int64(lim.Cur/4), 16)
}

// held counts the descriptors the producer holds for peers now (copies
// and handed-over sockets not yet closed by a discard worker).
var held atomic.Int64

// overdrawn reports whether the producer should accept no connection.
func overdrawn() bool { return held.Load() >= fdBudget() }

// oneRight is control space for exactly one descriptor: the kernel
// installs as many as the space holds (a CmsgSpace(4) would hold two).
var oneRight = unix.CmsgLen(4)

// errForeignDescriptor is a message taken whose one descriptor is not
// trusted; errDescriptors one left in its connection, with more than one;
// errNoDescriptorFree one left there because this process has no
// descriptor free to look at it with.
var (
	errForeignDescriptor = errors.New("a descriptor of another file")
	errDescriptors       = errors.New("more than one descriptor")
	errNoDescriptorFree  = errors.New("no descriptor free to look at the message's")
)

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

// handOver gives up a socket a peer can reach (a connection, the
// listener): shut down (the peer sees its end at once, and can queue
// nothing more), duplicated, the caller's own descriptor closed with
// closeOwn, and only then the duplicate given to the discard workers,
// whose close, the last, releases whatever it still queues (given first,
// a worker could close it before closeOwn, which would then be the last).
// With no descriptor free for the duplicate, the spare's number is used.
// It reports false when neither worked (f is left open: the caller must
// keep it so).
func handOver(f *os.File, closeOwn func(*os.File) error) bool {
	fd := RawFD(f)
	if fd < 0 {
		return true // already closed
	}
	_ = unix.Shutdown(fd, unix.SHUT_RDWR)
	d, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		d, err = dupToSpare(fd)
	} else {
		ensureSpare()
	}
	if err != nil {
		return false
	}
	_ = closeOwn(f)
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
	fds       []int // the one trusted descriptor it carried, counted in held
	truncated bool  // it did not fit buf
	ctrunc    bool  // its control data did not fit (it carries descriptors not taken)
}

// recvPeer receives one message from the peer's non-blocking socket fd
// into buf. It looks first (MSG_PEEK, with room for one descriptor: the
// kernel installs a copy of the first, counted in held): a message with
// no descriptor is taken; one with a single descriptor that trusted
// accepts (nil: none) is taken with it (the caller closes it at once with
// closeTrusted); one with a single other descriptor is taken too, the
// descriptor discarded, and errForeignDescriptor returned; one with more
// is left queued and errDescriptors returned. Copies and untrusted
// descriptors are closed on the discard workers (close() of any of them
// may wait: a FUSE file's flush).
func recvPeer(fd int, buf []byte, trusted func(fd int) bool) (message, error) {
	peek, err := recvmsg(fd, buf, oneRight, unix.MSG_PEEK)
	held.Add(int64(len(peek.fds)))
	if err != nil {
		return message{}, err
	}
	switch {
	case !peek.ctrunc && len(peek.fds) == 0:
		return recvmsg(fd, buf, 0, 0) // no descriptor: nothing can be dropped
	case !peek.ctrunc && len(peek.fds) == 1:
		// One descriptor: taken (so the connection's queue can empty,
		// and a refusal sent on it be read). The copy stays open until
		// then: if the descriptor cannot be installed (no descriptor
		// free), the kernel drops it here, and the copy makes that drop
		// not the last. Then both close: at once if trusted, else on the
		// discard workers.
		ok := trusted != nil && trusted(peek.fds[0])
		m, err := recvmsg(fd, buf, oneRight, 0)
		held.Add(int64(len(m.fds)))
		if ok {
			closeTrusted(peek.fds[0])
			if err == nil && len(m.fds) == 0 {
				return message{}, errNoDescriptorFree
			}
			return m, err
		}
		discard(append(peek.fds, m.fds...)...)
		if err != nil {
			return message{}, err
		}
		return message{}, errForeignDescriptor
	case peek.ctrunc && len(peek.fds) == 0:
		return message{}, errNoDescriptorFree // not even the copy could be installed
	}
	discard(peek.fds...)
	return message{}, errDescriptors
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
	return message{n: n, fds: rights(oob[:oobn]), truncated: rflags&unix.MSG_TRUNC != 0,
		ctrunc: rflags&unix.MSG_CTRUNC != 0}, nil
}

// rights are the descriptors of the SCM_RIGHTS messages in oob.
func rights(oob []byte) []int {
	msgs, err := unix.ParseSocketControlMessage(oob)
	if err != nil {
		return nil
	}
	var fds []int
	for i := range msgs {
		if f, err := unix.ParseUnixRights(&msgs[i]); err == nil {
			fds = append(fds, f...)
		}
	}
	return fds
}

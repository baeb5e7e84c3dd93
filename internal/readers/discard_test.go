package readers

import (
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

// stickWorkers stands in for discard workers stuck for good: what is
// discarded is appended to got (the test closes them), and stays counted
// in held until the test ends.
func stickWorkers(t *testing.T, got *[]int) {
	orig, before := discardHook, held.Load()
	discardHook = func(fds []int) { *got = append(*got, fds...) }
	t.Cleanup(func() {
		discardHook = orig
		held.Store(before)
	})
}

// openFds counts this process's open descriptors.
func openFds(t *testing.T) int {
	ents, err := os.ReadDir("/proc/self/fd")
	require.NoError(t, err)
	return len(ents)
}

// sendNull sends msg with count descriptors of /dev/null on fd.
func sendNull(t *testing.T, fd int, msg []byte, count int) {
	null, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(null)
	fds := make([]int, count)
	for i := range fds {
		fds[i] = null
	}
	var oob []byte
	if count > 0 {
		oob = unix.UnixRights(fds...)
	}
	require.NoError(t, unix.Sendmsg(fd, msg, oob, nil, 0))
}

// seqpacketPair is a connected pair: ours (non-blocking), the peer's.
func seqpacketPair(t *testing.T) (ours, peer int) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	require.NoError(t, unix.SetNonblock(pair[0], true))
	t.Cleanup(func() {
		unix.Close(pair[0])
		unix.Close(pair[1])
	})
	return pair[0], pair[1]
}

const manyRights = 253 // the most one message can carry (SCM_MAX_FD)

// isCharDevice trusts /dev/null (the tests' stand-in for the segment).
func isCharDevice(fd int) bool {
	var st unix.Stat_t
	return unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFCHR
}

// TestLookTakesNoForeignDescriptor (review 4, R1): a message carrying
// descriptors other than one trusted one is never received, whatever it
// carries: the look installs exactly one copy (counted, discarded), and
// the message stays queued.
func TestLookTakesNoForeignDescriptor(t *testing.T) {
	for _, count := range []int{2, 3, manyRights} {
		var got []int
		stickWorkers(t, &got)
		held.Store(0)
		ours, peer := seqpacketPair(t)
		before := openFds(t)
		sendNull(t, peer, []byte{1}, count)
		buf := make([]byte, 16)
		_, err := recvPeer(ours, buf, isCharDevice)
		require.ErrorIs(t, err, errDescriptors, "%d descriptors", count)
		assert.Len(t, got, 1, "one copy, discarded")
		assert.Equal(t, int64(1), held.Load(), "the copy is counted until a worker closes it")
		assert.Equal(t, before+1, openFds(t), "%d descriptors: none taken but the copy", count)
		_, err = recvPeer(ours, buf, isCharDevice)
		require.ErrorIs(t, err, errDescriptors, "the message is still there, unread")
		for _, fd := range got {
			unix.Close(fd)
		}
	}
}

// TestLookTakesATrustedDescriptor: a message with no descriptor is taken;
// one whose single descriptor is trusted is taken with it (the look's
// copy closed at once); one with a single untrusted descriptor is taken
// and reported, the descriptor and the copy on the discard workers.
func TestLookTakesATrustedDescriptor(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	held.Store(0)
	ours, peer := seqpacketPair(t)
	buf := make([]byte, 16)

	sendNull(t, peer, []byte{7}, 0)
	m, err := recvPeer(ours, buf, nil)
	require.NoError(t, err)
	assert.Equal(t, 1, m.n)
	assert.Empty(t, m.fds)

	before := openFds(t)
	sendNull(t, peer, []byte{8}, 1)
	m, err = recvPeer(ours, buf, isCharDevice)
	require.NoError(t, err)
	require.Len(t, m.fds, 1, "the trusted descriptor is taken")
	assert.Equal(t, int64(1), held.Load())
	closeTrusted(m.fds[0])
	assert.Equal(t, int64(0), held.Load())
	assert.Equal(t, before, openFds(t), "the copy was closed")
	assert.Empty(t, got)

	sendNull(t, peer, []byte{9}, 1)
	_, err = recvPeer(ours, buf, func(int) bool { return false })
	assert.ErrorIs(t, err, errForeignDescriptor)
	assert.Len(t, got, 2, "the look's copy and the descriptor go to the workers")
	assert.Equal(t, int64(2), held.Load())
	_, err = recvPeer(ours, buf, nil)
	assert.ErrorIs(t, err, unix.EAGAIN, "the message was taken: the queue is empty")
	for _, fd := range got {
		unix.Close(fd)
	}
}

// TestHandOverLeavesTheQueue: a connection that queues a thousand
// descriptors is given up as one descriptor (a duplicate for the
// workers), shut down first: the peer can queue nothing more.
func TestHandOverLeavesTheQueue(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	held.Store(0)
	ours, peer := seqpacketPair(t)
	for range 4 {
		sendNull(t, peer, []byte{1}, manyRights)
	}
	d, err := unix.Dup(ours)
	require.NoError(t, err)
	conn := os.NewFile(uintptr(d), "conn")
	before := openFds(t)
	require.True(t, handOver(conn, (*os.File).Close))
	assert.Equal(t, int64(1), held.Load())
	require.Len(t, got, 1)
	assert.Equal(t, before, openFds(t), "one descriptor (ours closed, the duplicate given), not the 1012 it queues")
	err = unix.Sendmsg(peer, []byte{1}, nil, nil, unix.MSG_NOSIGNAL)
	assert.ErrorIs(t, err, unix.EPIPE, "shut down before it was handed over")
	unix.Close(got[0])
}

// TestHandOverWithNoDescriptorFree: at the descriptor limit, a connection
// is still handed over (onto the spare's number), not closed here.
func TestHandOverWithNoDescriptorFree(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	ours, _ := seqpacketPair(t)
	d, err := unix.Dup(ours)
	require.NoError(t, err)
	conn := os.NewFile(uintptr(d), "conn")
	defer conn.Close()
	spareWas := spare
	require.GreaterOrEqual(t, spareWas, 0)

	var fill []int
	defer func() {
		for _, fd := range fill {
			unix.Close(fd)
		}
	}()
	var lim unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	low := lim
	low.Cur = uint64(openFds(t) + 16)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &low))
	defer func() { require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim)) }()
	for {
		fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			require.ErrorIs(t, err, unix.EMFILE)
			break
		}
		fill = append(fill, fd)
	}
	require.True(t, handOver(conn, (*os.File).Close), "handed over at EMFILE")
	require.Len(t, got, 1)
	assert.Equal(t, spareWas, got[0], "onto the spare's number")
	var st unix.Stat_t
	require.NoError(t, unix.Fstat(got[0], &st))
	assert.Equal(t, uint32(unix.S_IFSOCK), st.Mode&unix.S_IFMT, "the spare now holds the connection")
	for _, fd := range fill {
		unix.Close(fd)
	}
	fill = nil
	unix.Close(got[0])
	d2, err := unix.Dup(ours)
	require.NoError(t, err)
	require.True(t, handOver(os.NewFile(uintptr(d2), "conn"), (*os.File).Close))
	spareMu.Lock()
	assert.GreaterOrEqual(t, spare, 0, "a new spare once descriptors are free again")
	spareMu.Unlock()
}

// TestHandOverClosesOursFirst: the duplicate reaches the discard workers
// only after the caller's descriptor is closed, so the workers' close is
// the last one, which releases what the connection queues (a worker that
// closed the duplicate first would leave that release to the caller's
// thread: review 5's hang of Close on a lingering socket).
func TestHandOverClosesOursFirst(t *testing.T) {
	ours, _ := seqpacketPair(t)
	d, err := unix.Dup(ours)
	require.NoError(t, err)
	orig, before := discardHook, held.Load()
	ownOpen := true
	discardHook = func(fds []int) {
		_, err := unix.FcntlInt(uintptr(d), unix.F_GETFD, 0)
		ownOpen = err == nil
		for _, fd := range fds {
			unix.Close(fd)
		}
	}
	t.Cleanup(func() {
		discardHook = orig
		held.Store(before)
	})
	require.True(t, handOver(os.NewFile(uintptr(d), "conn"), (*os.File).Close))
	assert.False(t, ownOpen, "the caller's descriptor was closed before the workers got the duplicate")
}

// TestCloseListenerEndsBackloggedJoins (review 6, finding 1): with the
// discard workers stuck, a reader whose connection waits in the join
// socket's backlog sees its end when the listener closes (it was handed
// over whole before, and only the stuck workers' close would have ended
// it).
func TestCloseListenerEndsBackloggedJoins(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	defer func() {
		for _, fd := range got {
			unix.Close(fd)
		}
	}()
	addr := fmt.Sprintf("\x00tsock-test-backlog-%d", os.Getpid())
	ln, err := listenAt(addr)
	require.NoError(t, err)
	tb := &Table{ln: ln, guard: NoGuard{}}
	c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	defer unix.Close(c)
	require.NoError(t, unix.Connect(c, &unix.SockaddrUnix{Name: "@" + addr[1:]}))
	tb.closeListener()
	pfd := []unix.PollFd{{Fd: int32(c), Events: unix.POLLIN}}
	n, err := unix.Poll(pfd, 5000)
	require.NoError(t, err)
	require.Equal(t, 1, n, "the backlogged connection ended when the listener closed")
	assert.NotZero(t, pfd[0].Revents&(unix.POLLHUP|unix.POLLIN))
	var b [8]byte
	r, _ := unix.Read(c, b[:])
	assert.LessOrEqual(t, r, 0, "end of file, no reply")
}

// TestCloseListenerEndsBlockedConnects (review 7): with the discard
// workers stuck, connect() calls blocked on the join socket's full
// backlog end when the listener closes (the kernel wakes one per accept
// otherwise, and the rest only at the listener's last close, on a worker).
func TestCloseListenerEndsBlockedConnects(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	defer func() {
		for _, fd := range got {
			unix.Close(fd)
		}
	}()
	addr := fmt.Sprintf("\x00tsock-test-blocked-%d", os.Getpid())
	ln, err := listenAt(addr)
	require.NoError(t, err)
	tb := &Table{ln: ln, guard: NoGuard{}}
	sun := &unix.SockaddrUnix{Name: "@" + addr[1:]}
	var conns []int
	defer func() {
		for _, c := range conns {
			unix.Close(c)
		}
	}()
	for { // fill the backlog
		c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, 0)
		require.NoError(t, err)
		conns = append(conns, c)
		if unix.Connect(c, sun) != nil {
			break
		}
	}
	const blocked = listenBacklog + 20 // more than Close accepts
	ended := make(chan struct{}, blocked)
	for range blocked {
		go func() {
			c, err := unix.Socket(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
			if err == nil {
				// blocks: the backlog is full (a SockaddrUnix of its own:
				// Connect writes into it)
				_ = unix.Connect(c, &unix.SockaddrUnix{Name: sun.Name})
				unix.Close(c)
			}
			ended <- struct{}{}
		}()
	}
	time.Sleep(300 * time.Millisecond) // let them block
	tb.closeListener()
	deadline := time.After(10 * time.Second)
	for i := range blocked {
		select {
		case <-ended:
		case <-deadline:
			t.Fatalf("%d of %d connect() calls still blocked 10 s after the listener closed", blocked-i, blocked)
		}
	}
}

// TestTrustedCopyThenNoDescriptorFree (review 7): the look installs the
// trusted copy, the real receive then finds no descriptor free: the
// message is taken, the descriptor dropped by the kernel (the copy still
// held it: not the last close), and the join is refused as retryable;
// held is back where it was.
func TestTrustedCopyThenNoDescriptorFree(t *testing.T) {
	ours, peer := seqpacketPair(t)
	sendNull(t, peer, []byte{1}, 1)
	var lim unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	before := held.Load()
	_, err := recvPeer(ours, make([]byte, 16), func(d int) bool {
		low := lim
		low.Cur = uint64(d) // the copy's number: no other can be made
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &low)
		return isCharDevice(d)
	})
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	assert.ErrorIs(t, err, errNoDescriptorFree)
	assert.Equal(t, before, held.Load())
}

// lingeringTCP is a TCP socket whose last close blocks for secs: its send
// queue is full towards a listener that never accepts. release closes the
// listener, which resets the connection and so ends a close lingering on it.
func lingeringTCP(t *testing.T, secs int32) (c int, release func()) {
	l, err := unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	release = sync.OnceFunc(func() { unix.Close(l) })
	t.Cleanup(release)
	require.NoError(t, unix.SetsockoptInt(l, unix.SOL_SOCKET, unix.SO_RCVBUF, 4096))
	require.NoError(t, unix.Bind(l, &unix.SockaddrInet4{Addr: [4]byte{127, 0, 0, 1}}))
	require.NoError(t, unix.Listen(l, 8))
	sa, err := unix.Getsockname(l)
	require.NoError(t, err)
	c, err = unix.Socket(unix.AF_INET, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	require.NoError(t, unix.SetsockoptInt(c, unix.SOL_SOCKET, unix.SO_SNDBUF, 4096))
	require.NoError(t, unix.Connect(c, sa))
	require.NoError(t, unix.SetNonblock(c, true))
	buf := make([]byte, 1<<16)
	for idle := 0; idle < 200; { // until nothing more goes for 200 ms
		if _, err := unix.Write(c, buf); err != nil {
			idle++
			time.Sleep(time.Millisecond)
		} else {
			idle = 0
		}
	}
	require.NoError(t, unix.SetNonblock(c, false))
	require.NoError(t, unix.SetsockoptLinger(c, unix.SOL_SOCKET, unix.SO_LINGER, &unix.Linger{Onoff: 1, Linger: secs}))
	return c, release
}

// TestForeignDescriptorNoDescriptorFreeNotLastClose (review 6 #2, review
// 7): a message carrying one lingering socket, no descriptor free for the
// real receive, and a discard worker that closes the look's copy the
// moment it gets it: the kernel's drop of the undeliverable descriptor in
// recvPeer's thread must not be the last close (the copy is given to the
// workers only after the receive). Before the fix recvPeer waited out
// the socket's linger.
func TestForeignDescriptorNoDescriptorFreeNotLastClose(t *testing.T) {
	ours, peer := seqpacketPair(t)
	// The socket lingers 10 s, and recvPeer must return well before: 5 s
	// tells the two apart and leaves a loaded machine seconds for what
	// recvPeer does. The linger is then cut short (release), so the test
	// does not wait it out.
	const linger, bound = 10, 5 * time.Second
	c, release := lingeringTCP(t, linger)
	require.NoError(t, unix.Sendmsg(peer, []byte{1}, unix.UnixRights(c), nil, 0))
	unix.Close(c)
	orig, heldBefore := discardHook, held.Load()
	done := make(chan struct{}, 4)
	discardHook = func(fds []int) {
		queued, _, _ := unix.Recvfrom(ours, make([]byte, 1), unix.MSG_PEEK|unix.MSG_DONTWAIT)
		for _, fd := range fds {
			if queued > 0 { // the message is still queued: this worker was first
				unix.Close(fd)
				held.Add(-1)
				continue
			}
			go func() { unix.Close(fd); held.Add(-1); done <- struct{}{} }()
		}
	}
	t.Cleanup(func() {
		discardHook = orig
		held.Store(heldBefore)
	})
	var lim unix.Rlimit
	require.NoError(t, unix.Getrlimit(unix.RLIMIT_NOFILE, &lim))
	start := time.Now()
	_, err := recvPeer(ours, make([]byte, 16), func(d int) bool {
		low := lim
		low.Cur = uint64(d)
		_ = unix.Setrlimit(unix.RLIMIT_NOFILE, &low)
		return false
	})
	took := time.Since(start)
	require.NoError(t, unix.Setrlimit(unix.RLIMIT_NOFILE, &lim))
	t.Logf("recvPeer: %v after %v", err, took)
	assert.Less(t, took, bound, "the last close of a peer's lingering socket ran in recvPeer's thread")
	release()
	select {
	case <-done:
	case <-time.After(2 * linger * time.Second):
	}
}

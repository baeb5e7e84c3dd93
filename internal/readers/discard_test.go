package readers

import (
	"os"
	"testing"

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

// TestDrainTakesEveryQueuedDescriptor: a peer queues messages of 0 bytes
// (which look like the end of a shut-down socket's queue), then messages
// carrying descriptors; drainRights receives every one, so the
// connection's close drops none, and the peer can queue nothing after.
func TestDrainTakesEveryQueuedDescriptor(t *testing.T) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	require.NoError(t, err)
	ours, peer := pair[0], pair[1]
	defer unix.Close(peer)
	require.NoError(t, unix.SetNonblock(ours, true))
	var sent []int
	for i := 0; i < 3; i++ {
		require.NoError(t, unix.Sendmsg(peer, nil, nil, nil, 0))
		p, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_STREAM|unix.SOCK_CLOEXEC, 0)
		require.NoError(t, err)
		require.NoError(t, unix.Sendmsg(peer, []byte{1}, unix.UnixRights(p[:]...), nil, 0))
		sent = append(sent, p[:]...)
	}
	// Many descriptors in one message: all of them are received.
	var many []int
	for i := 0; i < maxRights; i++ {
		many = append(many, sent[0])
	}
	require.NoError(t, unix.Sendmsg(peer, nil, unix.UnixRights(many...), nil, 0))
	for _, fd := range sent {
		unix.Close(fd)
	}
	before := openFds(t)
	var got []int
	stickWorkers(t, &got)
	assert.True(t, drainRights(ours), "the queue was seen empty")
	assert.Len(t, got, len(sent)+maxRights, "every queued descriptor was received")
	assert.Equal(t, before+len(got), openFds(t))
	for _, fd := range got {
		unix.Close(fd)
	}
	err = unix.Sendmsg(peer, []byte{1}, nil, nil, unix.MSG_NOSIGNAL)
	assert.ErrorIs(t, err, unix.EPIPE, "nothing can be queued once drained")
	unix.Close(ours)
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

// TestBudgetBoundsDescriptorsPeersLeave (review 4, R1): with the discard
// workers stuck for good, a peer that keeps sending descriptors makes the
// producer hold no more than the budget; the message that does not fit
// stays in the peer's connection, unread.
func TestBudgetBoundsDescriptorsPeersLeave(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	held.Store(0)
	defer func() {
		for _, fd := range got {
			unix.Close(fd)
		}
	}()
	ours, peer := seqpacketPair(t)
	before := openFds(t)
	const messages = 8 // 2024 descriptors: four times the largest budget
	for range messages {
		sendNull(t, peer, []byte{1}, maxRights)
	}
	buf := make([]byte, 16)
	var err error
	for range messages {
		var m message
		if m, err = recvPeer(ours, buf, nil); err != nil {
			break
		}
		discard(m.fds...)
	}
	require.ErrorIs(t, err, errOverBudget)
	assert.LessOrEqual(t, held.Load(), fdBudget, "the producer holds no more than its budget")
	assert.Equal(t, int64(len(got)), held.Load(), "what it holds is counted")
	assert.LessOrEqual(t, openFds(t)-before, int(fdBudget))
	_, err = recvPeer(ours, buf, nil)
	assert.ErrorIs(t, err, errOverBudget, "the message is still there, unread")
}

// TestSpentBudgetStillTakesJoins: with less room than a full message, a
// message with no descriptor and a join's one trusted descriptor are
// still received (the trusted one closed at once); one untrusted
// descriptor is not (the copy the look made is discarded, counted). With
// no room at all, only messages without descriptors are.
func TestSpentBudgetStillTakesJoins(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	defer func() {
		for _, fd := range got {
			unix.Close(fd)
		}
	}()
	ours, peer := seqpacketPair(t)
	buf := make([]byte, 16)
	trusted := func(fd int) bool {
		var st unix.Stat_t
		return unix.Fstat(fd, &st) == nil && st.Mode&unix.S_IFMT == unix.S_IFCHR
	}
	room := fdBudget - 10
	held.Store(room)

	sendNull(t, peer, []byte{7}, 0)
	m, err := recvPeer(ours, buf, nil)
	require.NoError(t, err)
	assert.Equal(t, 1, m.n)
	assert.Empty(t, m.fds)

	sendNull(t, peer, []byte{8}, 1)
	m, err = recvPeer(ours, buf, trusted)
	require.NoError(t, err)
	require.Len(t, m.fds, 1, "the trusted descriptor is taken")
	assert.Equal(t, room+1, held.Load())
	closeTrusted(m.fds[0])
	assert.Equal(t, room, held.Load())

	sendNull(t, peer, []byte{9}, 1)
	_, err = recvPeer(ours, buf, func(int) bool { return false })
	assert.ErrorIs(t, err, errOverBudget, "an untrusted one is not")
	assert.Equal(t, room+1, held.Load(), "the look's copy is counted until a worker closes it")
	assert.Len(t, got, 1)

	// No room: the message waiting (one descriptor) is only looked at.
	held.Store(fdBudget)
	_, err = recvPeer(ours, buf, trusted)
	assert.ErrorIs(t, err, errOverBudget)
	assert.Equal(t, fdBudget, held.Load(), "no copy made")
	assert.Len(t, got, 1)
}

// TestDrainWithSpentBudgetHandsOver: a connection whose queue the budget
// cannot take is not seen drained, and is handed over whole: one
// descriptor more, whatever it queues.
func TestDrainWithSpentBudgetHandsOver(t *testing.T) {
	var got []int
	stickWorkers(t, &got)
	held.Store(fdBudget)
	ours, peer := seqpacketPair(t)
	for range 4 {
		sendNull(t, peer, []byte{1}, maxRights)
	}
	d, err := unix.Dup(ours)
	require.NoError(t, err)
	conn := os.NewFile(uintptr(d), "conn")
	defer conn.Close()
	before := openFds(t)
	assert.False(t, drainRights(ours))
	assert.Equal(t, before, openFds(t), "the look at the queue took none of its descriptors")
	require.True(t, handOver(conn))
	assert.Equal(t, fdBudget+1, held.Load())
	require.Len(t, got, 1)
	assert.Equal(t, before+1, openFds(t), "one descriptor, not the 1012 it queues")
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
	require.True(t, handOver(conn), "handed over at EMFILE")
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
	require.True(t, handOver(os.NewFile(uintptr(d2), "conn")))
	spareMu.Lock()
	assert.GreaterOrEqual(t, spare, 0, "a new spare once descriptors are free again")
	spareMu.Unlock()
}

package readers

import (
	"os"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"
)

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
	orig := discardHook
	discardHook = func(fds []int) { got = append(got, fds...) }
	defer func() { discardHook = orig }()
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

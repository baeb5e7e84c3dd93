package ring_test

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/ring"
)

func inspectName(t *testing.T, tag string) string {
	t.Helper()
	name := fmt.Sprintf("inspect-%d-%s-%d", os.Getpid(), tag, time.Now().UnixNano()%1e9)
	t.Cleanup(func() { os.Remove(ring.ChannelPath(name)) })
	return name
}

// writeSegment writes a valid segment file at the channel's path, with
// nobody holding its producer lock, and returns a writable mapping.
func writeSegment(t *testing.T, name string) *ring.Segment {
	t.Helper()
	g, ok := ring.ComputeGeometry(4, 3, 4096)
	require.True(t, ok)
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	require.NoError(t, err)
	require.NoError(t, f.Truncate(int64(g.TotalBytes)))
	seg, err := ring.MapSegment(f, g, 4, 3, true)
	require.NoError(t, err)
	seg.InitHeader(name, os.Getpid(), 1)
	t.Cleanup(func() { seg.Close() })
	return seg
}

// Regression: OpenSegment used os.Open, which follows a symbolic link
// planted at the channel's path and blocks forever on a FIFO planted
// there (so `tsock ls` hung). It must fail at once for both, and reject
// names that are not channel names.
func TestOpenSegmentRefusesLinksAndFifos(t *testing.T) {
	target := inspectName(t, "target")
	writeSegment(t, target)
	_, err := ring.OpenSegment(target)
	require.NoError(t, err, "the real segment opens")

	link := inspectName(t, "link")
	require.NoError(t, os.Symlink(ring.ChannelPath(target), ring.ChannelPath(link)))
	_, err = ring.OpenSegment(link)
	require.Error(t, err, "a link is not followed")
	assert.ErrorIs(t, err, syscall.ELOOP)

	fifo := inspectName(t, "fifo")
	require.NoError(t, syscall.Mkfifo(ring.ChannelPath(fifo), 0o600))
	done := make(chan error, 1)
	go func() { _, err := ring.OpenSegment(fifo); done <- err }()
	select {
	case err := <-done:
		assert.ErrorIs(t, err, ring.ErrNotSegment)
	case <-time.After(5 * time.Second):
		// Unblock the stuck open so the goroutine can end.
		if w, err := os.OpenFile(ring.ChannelPath(fifo), os.O_WRONLY, 0); err == nil {
			w.Close()
		}
		t.Fatal("OpenSegment blocked on a FIFO")
	}

	dir := inspectName(t, "dir")
	require.NoError(t, os.Mkdir(ring.ChannelPath(dir), 0o700))
	t.Cleanup(func() { os.Remove(ring.ChannelPath(dir)) })
	_, err = ring.OpenSegment(dir)
	assert.Error(t, err)

	for _, bad := range []string{"", ".", "..", "../" + target, "a/b", "/etc/passwd"} {
		_, err := ring.OpenSegment(bad)
		assert.Equal(t, ring.StatusName, ring.StatusOf(err), "%q: %v", bad, err)
	}
}

// lockShared takes an OFD read lock on byte b of f, as a reader does.
func lockShared(f *os.File, b int64) error {
	fl := unix.Flock_t{Type: unix.F_RDLCK, Start: b, Len: 1}
	return unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &fl)
}

// TestProducerLockIsAWriteLock: the producer's liveness is its write lock
// on byte 0; a read lock there, which anyone who may read the file can
// take (a reader of another user, say), does not make a dead producer
// look alive to readers and tools.
func TestProducerLockIsAWriteLock(t *testing.T) {
	name := inspectName(t, "plock")
	writeSegment(t, name)
	reader, err := os.Open(ring.ChannelPath(name))
	require.NoError(t, err)
	defer reader.Close()
	require.NoError(t, lockShared(reader, ring.LockProducer))
	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.Close()
	alive, err := seg.ProducerLocked()
	require.NoError(t, err)
	assert.False(t, alive, "a read lock on the producer byte is not a producer")
	require.NoError(t, reader.Close())
	w, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer w.Close()
	require.NoError(t, ring.LockByte(w, ring.LockProducer))
	alive, err = seg.ProducerLocked()
	require.NoError(t, err)
	assert.True(t, alive)
}

func TestInspectAccessors(t *testing.T) {
	name := inspectName(t, "acc")
	w := writeSegment(t, name)
	assert.Equal(t, name[:min(len(name), 31)], w.HeaderName())

	// Offsets pinned by layout.h's static asserts.
	assert.Equal(t, uintptr(0), ring.RosterOffClaim)
	assert.Equal(t, uintptr(0), ring.RecordOffCursor)
	assert.Equal(t, uintptr(128), ring.RecordOffSleeping)
	assert.Equal(t, uintptr(64), ring.SlotOffTensors)
	assert.Equal(t, uintptr(256), ring.HeaderOffPublished)
	assert.Equal(t, uintptr(128), ring.HeaderOffState)
	assert.Equal(t, uintptr(8), ring.HeaderOffLayoutVersion)
	assert.Equal(t, uintptr(ring.RosterEntrySize), uintptr(len(w.EntryBytes(0))))
	assert.Equal(t, uintptr(ring.SlotSize), uintptr(len(w.SlotBytes(3))))

	// An entry whose reader holds its (read) lock, one left ACTIVE by a
	// reader that died after its producer, one free: LiveRecords lists
	// the first two.
	lockFile, err := os.Open(ring.ChannelPath(name))
	require.NoError(t, err)
	defer lockFile.Close()
	require.NoError(t, lockShared(lockFile, ring.LockReader0+0))
	w.SetClaim(0, ring.MakeClaim(1, ring.ReaderActive))
	w.SetClaim(1, ring.MakeClaim(5, ring.ReaderActive))
	w.SetIdentity(1, ring.Identity{Pid: 77, Uid: 65534})
	w.Mirror(1, ring.Progress{Cursor: 4, Placement: ring.PlacementPinned})
	w.StorePublished(9)

	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.Close()
	recs, err := seg.LiveRecords()
	require.NoError(t, err)
	require.Len(t, recs, 2)
	assert.Equal(t, uint32(0), recs[0].Index)
	assert.True(t, recs[0].Locked)
	assert.Equal(t, ring.ReaderActive, recs[0].State)
	assert.Equal(t, uint32(1), recs[1].Index)
	assert.False(t, recs[1].Locked)
	assert.Equal(t, int32(77), recs[1].Pid)
	assert.Equal(t, uint32(65534), recs[1].Uid)
	assert.Equal(t, uint64(4), recs[1].Cursor)
	assert.Equal(t, ring.PlacementPinned, recs[1].Placement)
	assert.False(t, seg.ProducerWaiting())
	w.SetProducerWaiting(true)
	assert.True(t, seg.ProducerWaiting())
	assert.Equal(t, "active", ring.StateName(ring.ReaderActive))
	assert.Equal(t, "invalid", ring.StateName(77))
	assert.Equal(t, uint64(9), seg.Published())
	require.NoError(t, seg.Close())
	_, err = os.Stat(filepath.Join(ring.ShmDir, ring.ShmPrefix+name))
	assert.NoError(t, err, "Close does not remove anything")
}

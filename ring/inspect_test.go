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

func TestInspectAccessors(t *testing.T) {
	name := inspectName(t, "acc")
	w := writeSegment(t, name)
	assert.Equal(t, name[:min(len(name), 31)], w.HeaderName())

	// Offsets pinned by layout.h's static asserts.
	assert.Equal(t, uintptr(0), ring.RecordOffClaim)
	assert.Equal(t, uintptr(24), ring.RecordOffCursor)
	assert.Equal(t, uintptr(64), ring.SlotOffTensors)
	assert.Equal(t, uintptr(256), ring.HeaderOffPublished)
	assert.Equal(t, uintptr(128), ring.HeaderOffState)
	assert.Equal(t, uintptr(8), ring.HeaderOffLayoutVersion)
	assert.Equal(t, uintptr(ring.ReaderRecordSize), uintptr(len(w.RecordBytes(0))))
	assert.Equal(t, uintptr(ring.SlotSize), uintptr(len(w.SlotBytes(3))))
	assert.Equal(t, uintptr(ring.ReaderSharedSize), uintptr(len(w.ReaderSharedBytes())))

	// A record claimed by a process that holds its lock, one left ACTIVE by
	// a dead reader, one free: LiveRecords lists the first two.
	lockFile, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer lockFile.Close()
	require.NoError(t, ring.LockByte(lockFile, ring.LockReader0+0))
	require.True(t, w.CASClaim(0, 0, ring.MakeClaim(1, ring.ReaderActive)))
	require.True(t, w.CASClaim(1, 0, ring.MakeClaim(5, ring.ReaderActive)))
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

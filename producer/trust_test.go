package producer_test

import (
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// TestCloseRacesQueries: Stats, Readers and WaitReaders are documented as
// callable from any goroutine, so they may run while another goroutine
// closes the producer. Each must return (a value, or a status), never touch
// the unmapped segment. Before the fix this died of SIGSEGV in
// ring.(*Segment).Snapshot within a few iterations.
func TestCloseRacesQueries(t *testing.T) {
	iters := 200
	if testing.Short() {
		iters = 40
	}
	for it := 0; it < iters; it++ {
		name := testkit.Channel(t)
		p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096, MaxReaders: 8})
		require.NoError(t, err)
		r, err := reader.Attach(name, reader.Options{})
		require.NoError(t, err)
		require.NoError(t, publish(p, 0, time.Second))

		var stop atomic.Bool
		var wg sync.WaitGroup
		var calls [3]atomic.Int64 // per goroutine
		for g := 0; g < 3; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				for !stop.Load() {
					switch g {
					case 0:
						st := p.Stats()
						assert.LessOrEqual(t, st.Readers, 8)
					case 1:
						assert.LessOrEqual(t, len(p.Readers()), 8)
					case 2:
						err := p.WaitReaders(2, time.Millisecond)
						if err != nil {
							st := ring.StatusOf(err)
							assert.True(t, st == ring.StatusTimedOut || st == ring.StatusHandle, "WaitReaders: %v", err)
						}
					}
					calls[g].Add(1)
				}
			}(g)
		}
		// Every goroutine calls before the close, and again after it (a
		// closed producer answers, it does not crash), however they are
		// scheduled.
		waitCalls := func(min [3]int64) (now [3]int64) {
			deadline := time.Now().Add(30 * time.Second)
			for g := range calls {
				for calls[g].Load() < min[g] {
					if time.Now().After(deadline) {
						stop.Store(true)
						wg.Wait()
						t.Fatalf("goroutine %d made %d calls in 30 s, not %d", g, calls[g].Load(), min[g])
					}
					time.Sleep(50 * time.Microsecond)
				}
				now[g] = calls[g].Load()
			}
			return now
		}
		before := waitCalls([3]int64{1, 1, 1})
		require.NoError(t, p.Close())
		waitCalls([3]int64{before[0] + 2, before[1] + 2, before[2] + 2})
		stop.Store(true)
		wg.Wait()
		assert.Nil(t, p.Readers(), "a closed producer has no readers to list")
		assert.Equal(t, uint64(1), p.Stats().Published, "Stats after Close: the counters as Close left them")
		assert.Equal(t, ring.StatusHandle, ring.StatusOf(p.WaitReaders(0, 0)))
		require.NoError(t, r.Detach())
	}
}

// TestEvictionWithTimeoutZero: a producer that never waits (Reserve and
// EndEpoch with timeout 0, polling on ErrBackpressure: C reserve(..., 0),
// Python timeout=0) still applies EvictAfter: a stuck reader is evicted
// once it has gated the ring that long. Before the fix the timeout-0 path
// returned back-pressure without looking at the policy, for ever.
func TestEvictionWithTimeoutZero(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 64 << 10, EvictAfter: 50 * time.Millisecond})
	stuck := testkit.Attach(t, name, reader.Options{})
	require.NoError(t, p.WaitReaders(1, time.Second))
	require.NoError(t, publish(p, 0, 0))
	held, err := stuck.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, held)
	require.NoError(t, publish(p, 1, 0))

	start := time.Now()
	polls := 0
	for {
		err := publish(p, 2, 0)
		if err == nil {
			break
		}
		require.ErrorIs(t, err, producer.ErrBackpressure)
		polls++
		require.Less(t, time.Since(start), 3*time.Second, "stuck reader never evicted with timeout 0 (%d polls)", polls)
		time.Sleep(time.Millisecond)
	}
	waited := time.Since(start)
	t.Logf("evicted after %v and %d polls", waited, polls)
	assert.GreaterOrEqual(t, waited, 45*time.Millisecond, "not before EvictAfter")
	assert.Equal(t, uint64(1), p.Stats().ReadersEvicted)
	_, err = stuck.Acquire(0)
	require.ErrorIs(t, err, reader.ErrEvicted)

	// EndEpoch with timeout 0 takes the same path.
	r2 := testkit.Attach(t, name, reader.Options{Start: reader.StartNow})
	require.NoError(t, publish(p, 3, 0))
	b, err := r2.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	require.NoError(t, publish(p, 4, 0))
	start = time.Now()
	for {
		err := p.EndEpoch(0)
		if err == nil {
			break
		}
		require.ErrorIs(t, err, producer.ErrBackpressure)
		require.Less(t, time.Since(start), 3*time.Second, "EndEpoch(0) never evicts")
		time.Sleep(time.Millisecond)
	}
	assert.Equal(t, uint64(2), p.Stats().ReadersEvicted)
}

// noLeftovers asserts that dir holds no segment of name and no temporary
// file of this process.
func noLeftovers(t *testing.T, dir, name string) {
	t.Helper()
	_, err := os.Lstat(dir + "/" + ring.ShmPrefix + name)
	assert.ErrorIs(t, err, os.ErrNotExist, "a failed create leaves no channel")
	ents, err := os.ReadDir(dir)
	require.NoError(t, err)
	for _, e := range ents {
		assert.False(t, strings.HasPrefix(e.Name(), ".tsock-tmp."+strconv.Itoa(os.Getpid())+"."), "left %s", e.Name())
	}
}

// TestCreateTooBigForShm: a channel larger than the free space of /dev/shm
// fails at creation with a message naming both sizes (before the fix the
// sparse file was created, and the first touch of a page past the free
// space would have been SIGBUS).
func TestCreateTooBigForShm(t *testing.T) {
	var st unix.Statfs_t
	require.NoError(t, unix.Statfs(ring.ShmDir, &st))
	free := st.Bavail * uint64(st.Bsize)
	slots := uint32(2)
	for uint64(slots)*ring.MaxSlotBytes <= free {
		slots *= 2
		if slots > ring.MaxSlots {
			t.Skipf("%s has %d bytes free, more than the largest channel", ring.ShmDir, free)
		}
	}
	name := testkit.Channel(t)
	p, err := producer.Create(name, producer.Options{Slots: slots, SlotBytes: ring.MaxSlotBytes, MaxReaders: 1})
	if err == nil {
		p.Close()
	}
	require.Error(t, err, "a %d-slot channel of 16 GiB slots in a /dev/shm with %d bytes free", slots, free)
	assert.Equal(t, ring.StatusNoMem, ring.StatusOf(err))
	g, ok := ring.ComputeGeometry(slots, 1, ring.MaxSlotBytes)
	require.True(t, ok)
	assert.Contains(t, err.Error(), strconv.FormatUint(g.TotalBytes, 10), "names the size needed")
	assert.Contains(t, err.Error(), "free")
	t.Log(err)
	noLeftovers(t, ring.ShmDir, name)
}

// smallTmpfs mounts an 8 MiB tmpfs (root only) and makes the producer
// create its channels there.
func smallTmpfs(t *testing.T) string {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("mounting a tmpfs needs root")
	}
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=8m"); err != nil {
		t.Skipf("cannot mount a tmpfs here: %v", err)
	}
	t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
	t.Cleanup(producer.SetShmDirForTest(dir))
	return dir
}

// TestCreateReservesSpace: in an 8 MiB tmpfs, a 16 MiB channel fails at
// creation, by the statfs check and, with it turned off, by fallocate's
// ENOSPC; nothing is left behind. A channel that fits has all its pages
// allocated at creation: the filesystem's free space drops by its size at
// once (before the fix the sparse file took nothing until written, and a
// write past the free space was SIGBUS).
func TestCreateReservesSpace(t *testing.T) {
	dir := smallTmpfs(t)
	name := testkit.Channel(t)
	o := producer.Options{Slots: 4, SlotBytes: 4 << 20, MaxReaders: 1}
	_, err := producer.Create(name, o)
	require.Error(t, err)
	assert.Equal(t, ring.StatusNoMem, ring.StatusOf(err))
	assert.Contains(t, err.Error(), "free of 8388608")
	assert.NotContains(t, err.Error(), "decoded-sample caches take")
	t.Log(err)
	noLeftovers(t, dir, name)

	// A decoded-sample cache taking the room is named as the likely cause.
	cache := filepath.Join(dir, "tsock-cache.0.testkey")
	require.NoError(t, os.WriteFile(cache, make([]byte, 1<<20), 0o600))
	_, err = producer.Create(name, o)
	require.Error(t, err)
	assert.Contains(t, err.Error(), "1 decoded-sample caches take 1.0 MiB")
	assert.Contains(t, err.Error(), "tsock rm --caches")
	require.NoError(t, os.Remove(cache))

	restore := producer.SkipFreeCheckForTest()
	_, err = producer.Create(name, o)
	restore()
	require.Error(t, err)
	assert.Equal(t, ring.StatusNoMem, ring.StatusOf(err))
	assert.Contains(t, err.Error(), "no space left")
	t.Log(err)
	noLeftovers(t, dir, name)

	var before, after unix.Statfs_t
	require.NoError(t, unix.Statfs(dir, &before))
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 2 << 20, MaxReaders: 1})
	require.NoError(t, err)
	defer p.Close()
	require.NoError(t, unix.Statfs(dir, &after))
	g, _ := ring.ComputeGeometry(2, 1, 2<<20)
	used := (before.Bavail - after.Bavail) * uint64(before.Bsize)
	assert.GreaterOrEqual(t, used, g.TotalBytes, "the channel's pages are allocated at creation")
	// The reserved payload is writable, every byte of it.
	buf, err := p.Reserve(2<<20, 0)
	require.NoError(t, err)
	for i := range buf {
		buf[i] = byte(i)
	}
	require.NoError(t, p.Abort())
}

// TestCreateFallbackTempName: without O_TMPFILE, Create builds the segment
// under a hidden temporary name and links it; the channel works, and the
// temporary name is gone once created (and after a failed create).
func TestCreateFallbackTempName(t *testing.T) {
	t.Cleanup(producer.NoTmpfileForTest())
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 2, SlotBytes: 64 << 10, Mode: 0o640})
	st, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o640), st.Mode().Perm())
	r := testkit.Attach(t, name, reader.Options{})
	require.NoError(t, publish(p, 0, time.Second))
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	noLeftovers(t, ring.ShmDir, name+"-none")
	_, err = producer.Create(name, producer.Options{})
	require.ErrorIs(t, err, producer.ErrExist)
	noLeftovers(t, ring.ShmDir, name+"-none")
}

// TestCreateWaitsForReclaimer: a Create that finds its name's dead segment
// locked by a process reclaiming it (another channel's Create sweeping
// dead channels holds the producer lock for a moment, then unlinks it)
// waits for the name to go instead of failing with ErrExist. The
// reclaimer lets go once Create has found the lock held (from the test
// hook, not after a sleep that a loaded machine can stretch past Create's
// 50 ms).
func TestCreateWaitsForReclaimer(t *testing.T) {
	name := testkit.Channel(t)
	staleSegment(t, name, 0)
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, ring.LockByte(f, ring.LockProducer))
	found := 0
	defer producer.SetStaleLockedHookForTest(func() {
		if found++; found == 1 {
			os.Remove(ring.ChannelPath(name)) // what the reclaimer does, then it closes
			f.Close()
		}
	})()
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.NoError(t, err, "a reclaimer's moment on the lock is not a live producer")
	require.NoError(t, p.Close())
	assert.Equal(t, 1, found, "Create found the lock held once, then free")
}

// TestCreateGivesUpOnlyAfterLooking: a lock that stays held is a live
// producer, and Create fails with ErrExist, but only once a look taken 50
// ms after its first one still finds it held. A Create descheduled right
// after its first look (here the hook stalls it 80 ms, as a loaded machine
// can) looks again before it gives up: before the fix it counted the stall
// as 50 ms of a held lock, and a reclaimer that had let go meanwhile made
// Create fail with ErrExist.
func TestCreateGivesUpOnlyAfterLooking(t *testing.T) {
	name := testkit.Channel(t)
	staleSegment(t, name, 0)
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, ring.LockByte(f, ring.LockProducer))
	looks := 0
	defer producer.SetStaleLockedHookForTest(func() {
		if looks++; looks == 1 {
			time.Sleep(80 * time.Millisecond)
		}
	})()
	_, err = producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.ErrorIs(t, err, producer.ErrExist)
	assert.Equal(t, 2, looks, "one look after the stall, then ErrExist")
}

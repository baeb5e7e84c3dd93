package mp

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// TestHelperCreator is a child that creates and closes channel NAME (64
// MiB: most of its time is spent creating) until killed.
func TestHelperCreator(t *testing.T) {
	if os.Getenv(envRole) != "creator" {
		t.Skip("helper process")
	}
	name := os.Getenv(envArgs)
	fmt.Println("looping")
	for {
		p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 16 << 20, MaxReaders: 4})
		if err != nil {
			fmt.Println("create error:", err)
			os.Exit(1)
		}
		p.Close()
	}
}

// TestKilledInCreationLeavesNothing: a producer SIGKILLed at random
// instants, most of them inside Create, never leaves a file behind but a
// named channel (a dead one: reclaimed later, or tsock rm). Before the fix
// Create built the segment under /dev/shm/.tsock-tmp.PID.*, and a kill
// before the link left that 64 MiB file for good.
func TestKilledInCreationLeavesNothing(t *testing.T) {
	kills := 25
	if testing.Short() {
		kills = 8
	}
	left := 0
	for k := 0; k < kills; k++ {
		name := channel(t)
		c := start(t, "creator", []string{envRole + "=creator", envArgs + "=" + name}, os.Args[0], "-test.run=^TestHelperCreator$")
		c.waitLine(t, "looping", 30*time.Second)
		time.Sleep(time.Duration(rand.IntN(40)) * time.Millisecond)
		require.NoError(t, c.cmd.Process.Kill())
		c.wait(t, 10*time.Second)
		prefix := fmt.Sprintf(".tsock-tmp.%d.", c.cmd.Process.Pid)
		ents, err := os.ReadDir(ring.ShmDir)
		require.NoError(t, err)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), prefix) {
				left++
				os.Remove(ring.ShmDir + "/" + e.Name())
			}
		}
	}
	assert.Zero(t, left, "%d of %d producers killed while creating left a temporary file", left, kills)
}

// age makes a dead channel look older than the reclaim grace period: its
// file's modification time, and optionally its last publish (heartbeat).
func age(t *testing.T, name string, heartbeat uint64) {
	t.Helper()
	old := time.Now().Add(-time.Hour)
	require.NoError(t, os.Chtimes(ring.ChannelPath(name), old, old))
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], heartbeat)
	_, err = f.WriteAt(b[:], int64(ring.HeaderOffHeartbeatNs))
	require.NoError(t, err)
	require.NoError(t, os.Chtimes(ring.ChannelPath(name), old, old))
}

func exists(name string) bool {
	_, err := os.Lstat(ring.ChannelPath(name))
	return err == nil
}

// createOther creates and closes another channel: the Create that sweeps.
func createOther(t *testing.T) {
	t.Helper()
	p, err := producer.Create(channel(t), producer.Options{Slots: 2, SlotBytes: 4096, MaxReaders: 1})
	require.NoError(t, err)
	require.NoError(t, p.Close())
}

// TestDeadChannelReclaimed: a channel whose producer was killed is removed
// by the next Create of another channel of the same user, once nothing
// holds it: no producer, no reader, no sign of life for the grace period
// (its file's time, its last publish). One with a live reader still
// attached stays until the reader goes. Before the fix dead channels
// stayed until a producer took the same name or `tsock rm`.
func TestDeadChannelReclaimed(t *testing.T) {
	dead := channel(t)
	prod := startProducer(t, dead, producerSpec{readers: 0, batches: 0, slots: 4})
	prod.waitLine(t, "producer published", 30*time.Second)
	read := channel(t)
	prod2 := startProducer(t, read, producerSpec{readers: 0, batches: 0, slots: 4})
	prod2.waitLine(t, "producer published", 30*time.Second)
	r, err := reader.Attach(read, reader.Options{})
	require.NoError(t, err)
	defer r.Detach()
	require.NoError(t, prod.cmd.Process.Kill())
	require.NoError(t, prod2.cmd.Process.Kill())
	prod.wait(t, 10*time.Second)
	prod2.wait(t, 10*time.Second)

	createOther(t)
	assert.True(t, exists(dead), "a channel dead for less than the grace period is kept")

	age(t, dead, ring.MonotonicNs())
	age(t, read, 0)
	createOther(t)
	assert.True(t, exists(dead), "a channel that published within the grace period is kept")
	assert.True(t, exists(read), "a dead channel with a live reader is kept")

	age(t, dead, 1)
	createOther(t)
	assert.False(t, exists(dead), "a dead channel nobody holds is reclaimed")
	assert.True(t, exists(read), "a dead channel with a live reader is kept")

	require.NoError(t, r.Detach())
	age(t, read, 0)
	createOther(t)
	assert.False(t, exists(read), "reclaimed once its last reader detached")
}

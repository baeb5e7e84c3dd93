package mp

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

// TestKilledSleeperStopsWakeups: a reader SIGKILLed while asleep in acquire
// must not leave the producer waking nobody, with a FUTEX_WAKE system call,
// on every later publish. With a shared count of sleepers (layout 2) the
// dead reader's increment stayed for ever; with one bit per record the
// producer clears the bit when it reclaims the record.
func TestKilledSleeperStopsWakeups(t *testing.T) {
	const slots = 4
	name := channel(t)
	p := create(t, name, producer.Options{Slots: slots, SlotBytes: 64 << 10})
	r := startReader(t, name, readerSpec{lang: "c", start: "now"}, "sleeping c reader")
	require.NoError(t, p.WaitReaders(1, 30*time.Second))

	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.Close()
	deadline := time.Now().Add(20 * time.Second)
	for seg.Sleepers() != 1 { // nothing published: the reader spins 20 µs, then sleeps
		require.True(t, time.Now().Before(deadline), "the reader never went to sleep")
		time.Sleep(time.Millisecond)
	}
	require.NoError(t, r.cmd.Process.Kill())
	require.Equal(t, -1, r.wait(t, 10*time.Second), "killed by a signal")
	require.Equal(t, 1, seg.Sleepers(), "the dead reader's bit is still set: nobody else can clear it")

	// The dead reader's cursor holds the ring: once it is full the producer
	// finds the record's lock free, reclaims it and clears its bit.
	for i := uint64(0); i < 3*slots; i++ {
		_, err := publish(p, i, 10*time.Second)
		require.NoError(t, err, "publish %d", i)
	}
	require.Equal(t, 0, seg.Sleepers(), "the reclaimed record still asks for a wake-up on every publish")
	require.Equal(t, uint64(1), p.Stats().ReadersReclaimed)
	_, err = publish(p, 3*slots, 0)
	require.False(t, errors.Is(err, producer.ErrBackpressure), "nothing gates the producer any more")
}

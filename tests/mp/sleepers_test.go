package mp

import (
	"errors"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/producer"
)

// TestKilledSleeperStopsWakeups: a reader SIGKILLed while asleep in acquire
// must not leave the producer waking nobody, with a FUTEX_WAKE system call,
// on every later publish. With a shared count of sleepers (layout 2) the
// dead reader's increment stayed for ever; with one bit per record
// (layout 3) the producer cleared the bit once it reclaimed the record.
// Now the flag lives in the reader's own record, which the producer stops
// looking at the moment the reader's connection ends.
func TestKilledSleeperStopsWakeups(t *testing.T) {
	const slots = 4
	name := channel(t)
	p := create(t, name, producer.Options{Slots: slots, SlotBytes: 64 << 10})
	r := startReader(t, name, readerSpec{lang: "c", start: "now"}, "sleeping c reader")
	require.NoError(t, p.WaitReaders(1, 30*time.Second))

	deadline := time.Now().Add(20 * time.Second)
	for rs := p.Readers(); len(rs) != 1 || !rs[0].Sleeping; rs = p.Readers() {
		// nothing published: the reader spins 20 µs, then sleeps
		require.True(t, time.Now().Before(deadline), "the reader never went to sleep")
		time.Sleep(time.Millisecond)
	}
	require.NoError(t, r.cmd.Process.Kill())
	require.Equal(t, -1, r.wait(t, 10*time.Second), "killed by a signal")

	// Its connection ended with it: the producer frees its entry at once,
	// and with it the flag that asked for a wake-up on every publish.
	for deadline := time.Now().Add(10 * time.Second); len(p.Readers()) != 0; time.Sleep(time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "the dead reader is still attached: %+v", p.Readers())
	}
	require.Equal(t, uint64(1), p.Stats().ReadersReclaimed)
	for i := uint64(0); i < 3*slots; i++ {
		_, err := publish(p, i, 0)
		require.False(t, errors.Is(err, producer.ErrBackpressure), "nothing gates the producer any more")
		require.NoError(t, err, "publish %d", i)
	}
}

package producer_test

import (
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

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
		var calls atomic.Int64
		started := make(chan struct{}, 3)
		for g := 0; g < 3; g++ {
			wg.Add(1)
			go func(g int) {
				defer wg.Done()
				started <- struct{}{}
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
					calls.Add(1)
				}
			}(g)
		}
		for g := 0; g < 3; g++ {
			<-started
		}
		require.NoError(t, p.Close())
		// Keep calling after Close too: a closed producer answers, it does
		// not crash.
		time.Sleep(time.Millisecond)
		stop.Store(true)
		wg.Wait()
		assert.Positive(t, calls.Load())
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

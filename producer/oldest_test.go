package producer_test

import (
	"encoding/binary"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// Review 30, F1: a reader that moved its own cursor back after the
// producer's last scan made a StartOldest reader start at a batch the
// producer's cached minimum (p.cachedMin) already let it overwrite: the new
// reader acquired it (stamp fine) and the producer rewrote it under it. The
// start is now never below the highest minimum a scan returned.
func TestStartOldestNeverStartsBelowWhatTheProducerMayWrite(t *testing.T) {
	name := testkit.Channel(t)
	p := testkit.Create(t, name, producer.Options{Slots: 8, SlotBytes: 4096})
	publish := func(v uint64) {
		buf, err := p.Reserve(8, 0)
		require.NoError(t, err)
		binary.LittleEndian.PutUint64(buf, v)
		require.NoError(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint64, Shape: []int64{1}}}, nil))
	}
	rogue, err := testkit.JoinRogue(name, uint32(reader.StartNow))
	require.NoError(t, err)
	defer rogue.Close()
	rogue.Set(ring.RecordOffCursor, 1<<40) // "released everything": clamped to seq by every scan
	for v := uint64(0); v <= 8; v++ {
		publish(v) // the scan at seq 8 caches min 8: seqs up to 15 need no scan
	}
	rogue.Set(ring.RecordOffCursor, 0) // now "holds" batch 0: clamped by oldestHeld to 9-8+1 = 2
	victim := testkit.Attach(t, name, reader.Options{Start: reader.StartOldest})
	b, err := victim.Acquire(time.Second)
	require.NoError(t, err)
	before := binary.LittleEndian.Uint64(b.Tensors[0].Data)
	t.Logf("victim acquired seq %d (index %d), payload %d", b.Seq, b.Index, before)
	_, err = p.Reserve(8, 0)
	// With the victim's batch held, Reserve of seq 9 and 10 must wait (seq 10 is its slot).
	if err == nil {
		require.NoError(t, p.Publish([]producer.Tensor{{Dtype: ring.DtypeUint64, Shape: []int64{1}}}, nil))
		publish(10)
	}
	after := binary.LittleEndian.Uint64(b.Tensors[0].Data)
	t.Logf("victim's held batch (seq %d) now reads %d", b.Seq, after)
	require.Equal(t, before, after, "the producer overwrote a batch the StartOldest reader holds")
}

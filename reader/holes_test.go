package reader_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// Regression (found by FuzzAttachAcquire): batches the reader rejects
// (ECORRUPT) while the application holds an earlier batch were never
// released. Once max_held of them had piled up, every acquire returned
// ESTATE ("reader already holds N batches") although the application held
// nothing, forever, and the reader's cursor stayed put, so the producer was
// gated on it for good. A rejected batch must be released together with
// the held batches before it.
func TestRejectedBatchesDoNotWedgeTheReader(t *testing.T) {
	for _, maxHeld := range []int{2, 4} {
		name := testkit.Channel(t)
		fs := newFake(t, name, 16)
		r := testkit.Attach(t, name, reader.Options{MaxHeld: maxHeld})
		good := ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{10}}
		bad := ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{200}} // descriptor past the used payload

		fs.publish(t, good, 4096, 100) // seq 0
		held, err := r.Acquire(time.Second)
		require.NoError(t, err)
		require.NotNil(t, held)
		// While batch 0 is held, 2*maxHeld rejected batches arrive.
		for k := 0; k < 2*maxHeld; k++ {
			fs.publish(t, bad, 4096, 100)
		}
		fs.publish(t, good, 4096, 100) // seq 2*maxHeld+1
		rejected := 0
		for k := 0; k < 4*maxHeld; k++ {
			b, err := r.Acquire(0)
			if ring.StatusOf(err) == ring.StatusCorrupt {
				rejected++
				continue
			}
			if ring.StatusOf(err) == ring.StatusState {
				// Holding batch 0 plus rejected ones: release batch 0.
				require.NotNil(t, held, "ESTATE while holding nothing (max_held %d): %v", maxHeld, err)
				require.NoError(t, r.Release(held))
				held = nil
				continue
			}
			require.NoError(t, err)
			require.NotNil(t, b, "max_held %d: no batch after %d rejected", maxHeld, rejected)
			assert.Equal(t, uint64(2*maxHeld+1), b.Seq, "the next valid batch")
			require.NoError(t, r.Release(b))
			break
		}
		assert.Equal(t, 2*maxHeld, rejected, "max_held %d", maxHeld)
		// Everything was released: the producer is not gated on this reader.
		assert.Equal(t, fs.next, fs.cursor(t, 0), "max_held %d: cursor", maxHeld)
	}
}

package producer

import (
	"errors"
	"io/fs"

	"github.com/tsock/tsock/ring"
)

// Peeked is one published batch of a channel as Peek reads it.
type Peeked struct {
	ring.SlotPeek
	Published     uint64 // batches the channel's producer published, epoch markers included
	ProducerAlive bool   // a live producer holds the channel's producer lock
}

// Peek reads published batch `back` of channel name, counted back from the
// newest (0), whether its producer is alive or dead: its slot head and
// metadata, without attaching (no reader record, no lock). It is how a
// successor producer finds where a dead one stopped: the position travels
// in each batch's metadata, published atomically with the batch, so the
// newest batch is exactly the last one readers could get.
//
// Errors: StatusNoEnt (no channel), StatusPerm, StatusVersion, StatusCorrupt
// (not a segment, or a slot that cannot be one), StatusAgain when the ring
// no longer holds that batch (back >= published, back >= the slot count,
// or overwritten meanwhile by a live producer).
func Peek(name string, back uint64) (Peeked, error) {
	seg, err := ring.OpenSegment(name)
	if err != nil {
		return Peeked{}, openStatus(name, err)
	}
	defer seg.Close()
	published := seg.Published()
	if back >= published || back >= uint64(seg.SlotCount) {
		return Peeked{}, ring.Errorf(ring.StatusAgain, "channel %q: batch %d back from the newest is not in its ring "+
			"(%d published, %d slots)", name, back, published, seg.SlotCount)
	}
	seq := published - 1 - back
	p, ok, err := seg.PeekSlot(seq)
	if err != nil {
		return Peeked{}, err
	}
	if !ok {
		return Peeked{}, ring.Errorf(ring.StatusAgain, "channel %q: batch %d was overwritten", name, seq)
	}
	locked, err := seg.ProducerLocked()
	if err != nil {
		return Peeked{}, err
	}
	return Peeked{SlotPeek: p, Published: published, ProducerAlive: locked}, nil
}

// openStatus gives an error of ring.OpenSegment its tsock status.
func openStatus(name string, err error) error {
	switch {
	case errors.Is(err, fs.ErrNotExist):
		return ring.Errorf(ring.StatusNoEnt, "no channel %q", name)
	case errors.Is(err, fs.ErrPermission):
		return ring.Errorf(ring.StatusPerm, "channel %q: %v", name, err)
	case errors.Is(err, ring.ErrVersion):
		return ring.Errorf(ring.StatusVersion, "%v", err)
	case errors.Is(err, ring.ErrNotSegment), errors.Is(err, ring.ErrTruncated):
		return ring.Errorf(ring.StatusCorrupt, "%v", err)
	}
	return err
}

package producer

import (
	"fmt"
	"time"

	"github.com/tsock/tsock/ring"
)

// endReservation is Publish's and Abort's answer once closed: a batch
// still reserved is dropped, and the pages Close left mapped for it freed
// (under mu).
func (p *Producer) endReservation(err error) error {
	if p.closing.Load() && p.reserved {
		p.reserved = false
		p.kept.Free()
	}
	return err
}

// holdsBatch is Publish's and Abort's first check (under mu): the producer
// is open (else endReservation) and a batch is reserved for op.
func (p *Producer) holdsBatch(op string) error {
	if err := p.usable(); err != nil {
		return p.endReservation(err)
	}
	if !p.reserved {
		return ring.Errorf(ring.StatusState, "%s without a reserved batch", op)
	}
	return nil
}

// HoldsReservation reports whether a batch is reserved (and, once closed,
// its payload's pages still mapped until Publish or Abort).
func (p *Producer) HoldsReservation() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.reserved
}

// Reserve waits for the next slot and returns its payload buffer, nbytes
// long: write the batch there, then Publish. timeout 0 returns
// ErrBackpressure at once when the ring is full; a negative timeout waits
// without limit (dead readers are still freed).
func (p *Producer) Reserve(nbytes uint64, timeout time.Duration) ([]byte, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return nil, err
	}
	if p.reserved {
		return nil, ring.Errorf(ring.StatusState, "a batch is already reserved: publish or abort it first")
	}
	if nbytes > p.seg.Geometry.SlotPayloadBytes {
		return nil, ring.Errorf(ring.StatusTooBig, "batch of %d bytes exceeds the channel's %d bytes per slot",
			nbytes, p.seg.Geometry.SlotPayloadBytes)
	}
	if err := p.gate(p.next, timeout); err != nil {
		return nil, err
	}
	if err := p.slotIdle(p.next); err != nil {
		return nil, err
	}
	p.seg.BeginSlot(p.next)
	p.reserved, p.resBytes = true, nbytes
	return p.seg.Payload(p.next)[:nbytes], nil
}

// Publish makes the reserved batch visible to readers: tensors laid out in
// the payload, and up to 256 bytes of metadata. On error the reservation
// stays and may be published again.
func (p *Producer) Publish(tensors []Tensor, meta []byte) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.holdsBatch("publish"); err != nil {
		return err
	}
	if len(tensors) > ring.MaxTensors {
		return ring.Errorf(ring.StatusTooBig, "batch has %d tensors, at most %d", len(tensors), ring.MaxTensors)
	}
	if len(meta) > ring.MetaMax {
		return ring.Errorf(ring.StatusTooBig, "metadata of %d bytes, at most %d", len(meta), ring.MetaMax)
	}
	for i := range tensors {
		if st, err := tensors[i].Fill(&p.descs[i], p.resBytes); st != ring.StatusOK {
			return ring.Errorf(st, "tensor %d: %v", i, err)
		}
	}
	c := ring.SlotContents{Epoch: p.epoch, Index: p.index, Tensors: tensors, Meta: meta,
		PayloadBytes: p.resBytes, PayloadKind: ring.PayloadHost}
	if p.pool != nil {
		if err := p.pool.copySlot(uint32(p.seg.SlotIndex(p.next)), p.resBytes); err != nil {
			return fmt.Errorf("batch %d: copy to the device pool: %w", p.next, err)
		}
		c.PayloadKind = ring.PayloadHostDevice
	}
	p.write(c, len(tensors))
	p.index++
	return nil
}

// slotIdle returns once the device pool's last copy out of seq's slot has
// read the host payload, so that the slot may be written again.
func (p *Producer) slotIdle(seq uint64) error {
	if p.pool == nil {
		return nil
	}
	if err := p.pool.waitSlot(uint32(p.seg.SlotIndex(seq))); err != nil {
		return fmt.Errorf("slot of batch %d: %w", seq, err)
	}
	return nil
}

// Abort drops the reserved batch.
func (p *Producer) Abort() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.holdsBatch("abort"); err != nil {
		return err
	}
	p.reserved = false
	return nil
}

// EndEpoch publishes the epoch-end marker (no tensors, index = batches in
// the epoch) and starts the next epoch. It waits for a slot like Reserve.
func (p *Producer) EndEpoch(timeout time.Duration) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if err := p.usable(); err != nil {
		return err
	}
	if p.reserved {
		return ring.Errorf(ring.StatusState, "a batch is reserved: publish or abort it before ending the epoch")
	}
	if err := p.gate(p.next, timeout); err != nil {
		return err
	}
	if err := p.slotIdle(p.next); err != nil {
		return err
	}
	p.seg.BeginSlot(p.next)
	p.write(ring.SlotContents{Epoch: p.epoch, Index: p.index, Flags: ring.FlagEpochEnd}, 0)
	p.epoch++
	p.index = 0
	p.seg.SetEpoch(p.epoch)
	p.seg.SetEpochStart(p.next)
	return nil
}

// write fills the slot of p.next and publishes it.
func (p *Producer) write(c ring.SlotContents, n int) {
	seq := p.next
	c.PublishNs = ring.MonotonicNs()
	p.seg.SetHeartbeat(c.PublishNs)
	p.seg.WriteSlot(seq, &c, p.descs[:n])
	p.next = seq + 1
	p.reserved = false
	p.seg.StorePublished(p.next)
	// Sequentially consistent store above, loads here: pairs with a reader
	// that sets its sleeping flag and then re-reads published before
	// sleeping (docs/ARCHITECTURE.md, "Acquire and release").
	if p.table.AnySleeping() {
		ring.FutexWakeAll(p.seg.PublishedWord())
	}
}

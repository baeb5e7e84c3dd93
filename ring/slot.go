package ring

import (
	"fmt"
	"sync/atomic"
	"unsafe"
)

// Tensor describes one tensor of a batch, placed in the slot's payload.
type Tensor struct {
	Dtype   int32
	Shape   []int64
	Strides []int64 // in elements; nil means C-contiguous
	Offset  uint64  // bytes from the payload start
	Nbytes  uint64  // bytes spanned from Offset; 0 means computed from the shape
}

// SlotContents is what the producer writes into a slot besides the payload.
type SlotContents struct {
	Epoch, Index uint64
	Flags        uint32
	Tensors      []Tensor
	Meta         []byte
	PayloadBytes uint64 // payload bytes in use
	PublishNs    uint64
	PayloadKind  uint32 // PayloadHost, or PayloadHostDevice once copied to the device pool
}

// Fill converts t into a shared-memory descriptor and checks it against a
// payload of payloadBytes with the rule of layout.h. It returns the status
// (StatusDtype, StatusTooBig) and a message on failure.
func (t *Tensor) Fill(d *ShmTensor, payloadBytes uint64) (int, error) {
	nd := len(t.Shape)
	if nd > MaxDims {
		return StatusDtype, fmt.Errorf("tensor has %d dimensions, at most %d", nd, MaxDims)
	}
	if t.Strides != nil && len(t.Strides) != nd {
		return StatusDtype, fmt.Errorf("tensor has %d strides for %d dimensions", len(t.Strides), nd)
	}
	item := DtypeSize(t.Dtype)
	if item == 0 {
		return StatusDtype, fmt.Errorf("unsupported dtype %d", t.Dtype)
	}
	*d = ShmTensor{}
	d.dtype, d.ndim, d.offset = C32s(t.Dtype), C32s(int32(nd)), C64(t.Offset)
	count := uint64(1)
	for i := nd - 1; i >= 0; i-- {
		d.shape[i] = C64s(t.Shape[i])
		if t.Strides != nil {
			d.strides[i] = C64s(t.Strides[i])
		} else {
			d.strides[i] = C64s(int64(count))
		}
		if t.Shape[i] > 0 {
			count *= uint64(t.Shape[i])
		}
	}
	d.nbytes = C64(t.Nbytes)
	if t.Nbytes == 0 && t.Strides != nil {
		d.nbytes = C64(stridedSpan(t.Shape, t.Strides, uint64(item)))
	}
	if t.Nbytes == 0 && t.Strides == nil {
		d.nbytes = C64(count * uint64(item))
		for _, e := range t.Shape {
			if e == 0 {
				d.nbytes = 0
			}
		}
	}
	if st := CheckTensor(d, payloadBytes); st != StatusOK {
		return st, fmt.Errorf("tensor (dtype %d, shape %v, offset %d, %d bytes) does not fit a %d-byte payload",
			t.Dtype, t.Shape, t.Offset, uint64(d.nbytes), payloadBytes)
	}
	return StatusOK, nil
}

// stridedSpan is the bytes a strided tensor spans from its first element:
// (index of the furthest element + 1) * item; 0 for an empty tensor, and
// also 0 when it overflows or a value is negative (the tensor check then
// rejects the descriptor).
func stridedSpan(shape, strides []int64, item uint64) uint64 {
	last := uint64(0)
	for i := range shape {
		if shape[i] < 0 || strides[i] < 0 {
			return 0
		}
		if shape[i] == 0 {
			return 0
		}
		span, st := uint64(shape[i]-1), uint64(strides[i])
		if st != 0 && span > (^uint64(0)-last)/st {
			return 0
		}
		last += span * st
	}
	if last >= ^uint64(0)/item {
		return 0
	}
	return (last + 1) * item
}

// BeginSlot marks the slot of seq as being written (stamp 0), so a reader
// that was lapped cannot take its half-written descriptors for valid ones.
// The 0 must become visible before any store that follows (the caller's
// payload, WriteSlot's descriptors): beginSlot, per architecture
// (order_*.go), see there and docs/ARCHITECTURE.md, Publish.
func (s *Segment) BeginSlot(seq uint64) {
	beginSlot(u64(&s.SlotAt(seq).stamp))
}

// WriteSlot fills the slot of seq and stamps it seq+1 last. The tensors
// must already have been checked with Tensor.Fill into descs.
func (s *Segment) WriteSlot(seq uint64, c *SlotContents, descs []ShmTensor) {
	sl := s.SlotAt(seq)
	sl.epoch, sl.index = C64(c.Epoch), C64(c.Index)
	sl.flags, sl.n_tensors = C32(c.Flags), C32(len(descs))
	sl.payload_bytes, sl.meta_len = C64(c.PayloadBytes), C32(len(c.Meta))
	sl.payload_kind, sl.publish_ns = C32(c.PayloadKind), C64(c.PublishNs)
	copy(sl.tensors[:], descs)
	if len(c.Meta) > 0 {
		copy(unsafe.Slice((*byte)(unsafe.Pointer(&sl.meta[0])), MetaMax), c.Meta)
	}
	atomic.StoreUint64(u64(&sl.stamp), seq+1)
}

// SlotStamp is the seqlock stamp of the slot holding seq.
func (s *Segment) SlotStamp(seq uint64) uint64 { return atomic.LoadUint64(u64(&s.SlotAt(seq).stamp)) }

// SlotHead is the part of a slot a tool reads to describe it.
type SlotHead struct {
	Stamp, Epoch, Index uint64
	Flags, NTensors     uint32
	PayloadBytes        uint64
	PublishNs           uint64
}

// ReadSlotHead reads the head of the slot holding seq (not seqlocked: for
// inspection only).
func (s *Segment) ReadSlotHead(seq uint64) SlotHead {
	sl := s.SlotAt(seq)
	return SlotHead{Stamp: atomic.LoadUint64(u64(&sl.stamp)), Epoch: uint64(sl.epoch),
		Index: uint64(sl.index), Flags: uint32(sl.flags), NTensors: uint32(sl.n_tensors),
		PayloadBytes: uint64(sl.payload_bytes), PublishNs: uint64(sl.publish_ns)}
}

package ring

import (
	"unsafe"
)

// GPUPool is the device-pool part of a header (layout.h, lines 8-9): the
// producer's CUDA allocation that holds a copy of every slot's payload,
// exported once through CUDA IPC.
type GPUPool struct {
	Ordinal   int32    // the producer's CUDA ordinal (informational)
	PoolBytes uint64   // SlotCount * SlotPayloadBytes
	UUID      [16]byte // the pool's GPU; readers look for it among theirs
	MemHandle [64]byte // CUipcMemHandle
}

// SetGPUPool records the device pool in a header being built, before
// InitHeader publishes it (written once, never changed).
func (s *Segment) SetGPUPool(p *GPUPool) {
	h := s.Header()
	h.gpu_pool = 1
	h.gpu_ordinal = C32s(p.Ordinal)
	h.gpu_pool_bytes = C64(p.PoolBytes)
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&h.gpu_uuid[0])), CUDAUUIDBytes), p.UUID[:])
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&h.gpu_mem_handle[0])), CUDAHandleBytes), p.MemHandle[:])
}

// GPUPool reads the header's device pool; ok is false when it has none.
func (s *Segment) GPUPool() (p GPUPool, ok bool) {
	h := s.Header()
	if uint32(h.gpu_pool) != 1 {
		return p, false
	}
	p.Ordinal, p.PoolBytes = int32(h.gpu_ordinal), uint64(h.gpu_pool_bytes)
	p.UUID = *(*[16]byte)(unsafe.Pointer(&h.gpu_uuid[0]))
	p.MemHandle = *(*[64]byte)(unsafe.Pointer(&h.gpu_mem_handle[0]))
	return p, true
}

// SlotEventHandle is where slot i's CUipcEventHandle lives (written once
// while the segment is built, before InitHeader).
func (s *Segment) SlotEventHandle(i uint32) []byte {
	sl := s.SlotAt(uint64(i))
	return unsafe.Slice((*byte)(unsafe.Pointer(&sl.cuda_event[0])), CUDAHandleBytes)
}

// PayloadBase is the whole payload area of the mapping, every slot's
// payload in slot order: the range the producer registers with CUDA and
// copies from.
func (s *Segment) PayloadBase() []byte {
	off := s.Geometry.PayloadOffset
	return s.mem[off:s.Geometry.TotalBytes]
}

package ring

import (
	"sync/atomic"
	"unsafe"
)

// Read-only accessors for tools (tsock ls/stat/rm, the soak test) and the
// byte offsets of the shared structs, for tests that write raw records or
// slots as a buggy or hostile process would. Nothing here takes a lock or
// writes to the segment.

// Byte offsets of the reader record's fields (layout.h,
// tsock_reader_record), for tests that write a record as a hostile reader.
const (
	RecordOffCursor      = unsafe.Offsetof(ReaderRecord{}.cursor)
	RecordOffAcquired    = unsafe.Offsetof(ReaderRecord{}.acquired)
	RecordOffHeartbeatNs = unsafe.Offsetof(ReaderRecord{}.heartbeat_ns)
	RecordOffWaitNs      = unsafe.Offsetof(ReaderRecord{}.wait_ns)
	RecordOffBatches     = unsafe.Offsetof(ReaderRecord{}.batches)
	RecordOffPlacement   = unsafe.Offsetof(ReaderRecord{}.placement)
	RecordOffCUDAOrdinal = unsafe.Offsetof(ReaderRecord{}.cuda_ordinal)
	RecordOffGPUUUID     = unsafe.Offsetof(ReaderRecord{}.gpu_uuid)
	RecordOffSleeping    = unsafe.Offsetof(ReaderRecord{}.sleeping)
	RecordOffAttached    = unsafe.Offsetof(ReaderRecord{}.attached)
)

// Byte offsets of roster entry fields (tsock_roster_entry).
const (
	RosterOffClaim = unsafe.Offsetof(RosterEntry{}.claim)
	RosterOffPid   = unsafe.Offsetof(RosterEntry{}.pid)
)

// Byte offsets of a slot's fields (tsock_slot) and of a tensor descriptor's
// fields (tsock_shm_tensor, relative to the descriptor).
const (
	SlotOffStamp        = unsafe.Offsetof(Slot{}.stamp)
	SlotOffEpoch        = unsafe.Offsetof(Slot{}.epoch)
	SlotOffIndex        = unsafe.Offsetof(Slot{}.index)
	SlotOffFlags        = unsafe.Offsetof(Slot{}.flags)
	SlotOffNTensors     = unsafe.Offsetof(Slot{}.n_tensors)
	SlotOffPayloadBytes = unsafe.Offsetof(Slot{}.payload_bytes)
	SlotOffMetaLen      = unsafe.Offsetof(Slot{}.meta_len)
	SlotOffPayloadKind  = unsafe.Offsetof(Slot{}.payload_kind)
	SlotOffPublishNs    = unsafe.Offsetof(Slot{}.publish_ns)
	SlotOffTensors      = unsafe.Offsetof(Slot{}.tensors)
	SlotOffMeta         = unsafe.Offsetof(Slot{}.meta)

	TensorOffDtype   = unsafe.Offsetof(ShmTensor{}.dtype)
	TensorOffNdim    = unsafe.Offsetof(ShmTensor{}.ndim)
	TensorOffOffset  = unsafe.Offsetof(ShmTensor{}.offset)
	TensorOffNbytes  = unsafe.Offsetof(ShmTensor{}.nbytes)
	TensorOffShape   = unsafe.Offsetof(ShmTensor{}.shape)
	TensorOffStrides = unsafe.Offsetof(ShmTensor{}.strides)
)

// Byte offsets of header fields that tools and tests address directly.
const (
	HeaderOffLayoutVersion = unsafe.Offsetof(Header{}.layout_version)
	HeaderOffState         = unsafe.Offsetof(Header{}.state)
	HeaderOffEpochStart    = unsafe.Offsetof(Header{}.epoch_start)
	HeaderOffJoinWindow    = unsafe.Offsetof(Header{}.join_window)
	HeaderOffGPUPool       = unsafe.Offsetof(Header{}.gpu_pool)
	HeaderOffGPUOrdinal    = unsafe.Offsetof(Header{}.gpu_ordinal)
	HeaderOffGPUPoolBytes  = unsafe.Offsetof(Header{}.gpu_pool_bytes)
	HeaderOffGPUUUID       = unsafe.Offsetof(Header{}.gpu_uuid)
	HeaderOffPublished     = unsafe.Offsetof(Header{}.published)
	HeaderOffHeartbeatNs   = unsafe.Offsetof(Header{}.heartbeat_ns)
	HeaderOffJoinKey       = unsafe.Offsetof(Header{}.join_key)
)

// Close unmaps the segment and closes its file.
func (s *Segment) Close() error {
	err := s.Unmap()
	if cerr := s.File.Close(); err == nil {
		err = cerr
	}
	return err
}

// ProducerWaiting reports whether the producer is blocked in reserve,
// waiting for the slowest reader (back-pressure now).
func (s *Segment) ProducerWaiting() bool {
	return atomic.LoadUint32(u32(&s.Header().producer_waiting)) != 0
}

// HeaderName is the (possibly cut) channel name the producer wrote into the
// header; informational, the file name is authoritative.
func (s *Segment) HeaderName() string {
	h := s.Header()
	b := unsafe.Slice((*byte)(unsafe.Pointer(&h.name[0])), len(h.name))
	n := 0
	for n < len(b) && b[n] != 0 {
		n++
	}
	return string(b[:n])
}

// EntryBytes is roster entry i as raw bytes of the mapping (read-only
// unless the segment was mapped writable).
func (s *Segment) EntryBytes(i uint32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(s.Entry(i))), RosterEntrySize)
}

// SlotBytes is the slot holding seq as raw bytes.
func (s *Segment) SlotBytes(seq uint64) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(s.SlotAt(seq))), SlotSize)
}

// RecordLive is what a tool needs to know about one roster entry: its
// claim state and whether a live process holds its byte's lock.
type RecordLive struct {
	Index uint32
	RecordSnapshot
	State  uint32 // ReaderFree, ReaderActive, ReaderEvicted or garbage
	Locked bool   // a live process holds a lock on the entry's byte (its reader, while attached)
}

// LiveRecords lists the roster entries that are in use: claimed (not FREE)
// or locked by a live process. A live producer frees the entry of a reader
// that dies at once; entries of readers that died after their producer
// appear ACTIVE with Locked false.
func (s *Segment) LiveRecords() ([]RecordLive, error) {
	var out []RecordLive
	for i := uint32(0); i < s.Readers; i++ {
		snap := s.Snapshot(i)
		locked, err := s.ReaderLocked(i)
		if err != nil {
			return nil, err
		}
		st := ClaimState(snap.Claim)
		if st == ReaderFree && !locked {
			continue
		}
		out = append(out, RecordLive{Index: i, RecordSnapshot: snap, State: st, Locked: locked})
	}
	return out, nil
}

// StateName names a reader record state.
func StateName(st uint32) string {
	switch st {
	case ReaderFree:
		return "free"
	case ReaderActive:
		return "active"
	case ReaderEvicted:
		return "evicted"
	}
	return "invalid"
}

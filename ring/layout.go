// Package ring is the Go view of tsock's shared-memory segment: the structs
// of layout.h read through cgo (so Go and C cannot disagree on an offset),
// ring arithmetic, and the Linux primitives the protocol stands on (futexes,
// OFD byte locks, process identity).
//
// The producer writes the segment through this package; readers in C read it
// through the same header. docs/ARCHITECTURE.md describes the protocol.
package ring

/*
#cgo CFLAGS: -I${SRCDIR}/../include -Wall -Wextra -Werror
#include <stdlib.h>
#include "layout.h"

static inline int ring_check_tensor(int32_t dtype, int32_t ndim, const int64_t *shape,
                             const int64_t *strides, uint64_t offset, uint64_t nbytes,
                             uint64_t payload) {
	return tsock_layout_check_tensor(dtype, ndim, shape, strides, offset, nbytes, payload);
}
static inline int ring_geometry(uint32_t slots, uint32_t readers, uint64_t slot_bytes, tsock_geometry *g) {
	return tsock_layout_geometry(slots, readers, slot_bytes, g);
}
static inline const char *ring_status_str(int st) { return tsock_layout_status_str(st); }
static inline int ring_name_ok(const char *name) { return tsock_layout_name_ok(name); }
static inline uint32_t ring_dtype_size(int32_t dtype) { return tsock_layout_dtype_size(dtype); }
static inline int ring_check_header(const tsock_header *h, uint64_t size, int *why) {
	return tsock_layout_check_header(h, size, why);
}
static inline uint32_t ring_join_address(const uint8_t *key, char *path) {
	return tsock_layout_join_address(key, path);
}
*/
import "C"

import (
	"time"
	"unsafe"
)

// Shared-memory structs, exactly as layout.h defines them.
type (
	// Header is the segment's first page, written by the producer only.
	Header = C.tsock_header
	// RosterEntry is one reader's entry in the segment's roster, written
	// by the producer only.
	RosterEntry = C.tsock_roster_entry
	// ReaderRecord is what one reader writes: its own memfd, never the
	// segment.
	ReaderRecord = C.tsock_reader_record
	// JoinRequest and JoinReply are the messages of the join.
	JoinRequest = C.tsock_join_request
	JoinReply   = C.tsock_join_reply
	// Slot is one entry of the ring: a batch's descriptors.
	Slot = C.tsock_slot
	// ShmTensor is a tensor descriptor inside a slot.
	ShmTensor = C.tsock_shm_tensor
)

// Constants of the layout, from layout.h and tsock.h.
const (
	Magic         = uint64(C.TSOCK_MAGIC)
	LayoutVersion = uint32(C.TSOCK_LAYOUT_VERSION)
	PageSize      = uint64(C.TSOCK_PAGE)
	MaxDims       = int(C.TSOCK_MAX_DIMS)
	MaxTensors    = int(C.TSOCK_MAX_TENSORS)
	MetaMax       = int(C.TSOCK_META_MAX)
	NameMax       = int(C.TSOCK_NAME_MAX)
	MinSlots      = uint32(C.TSOCK_MIN_SLOTS)
	MaxSlots      = uint32(C.TSOCK_MAX_SLOTS)
	MaxReaders    = uint32(C.TSOCK_MAX_READERS)
	MaxSlotBytes  = uint64(C.TSOCK_MAX_SLOT_BYTES)
	ShmDir        = C.TSOCK_SHM_DIR
	ShmPrefix     = C.TSOCK_SHM_PREFIX

	MirrorPeriod    = time.Duration(C.TSOCK_MIRROR_MS) * time.Millisecond
	RecordFileBytes = int64(C.TSOCK_RECORD_FILE_BYTES)
	JoinMagic       = uint64(C.TSOCK_JOIN_MAGIC)
	JoinKeyBytes    = int(C.TSOCK_JOIN_KEY_BYTES)
	JoinInWindow    = uint32(C.TSOCK_JOIN_IN_WINDOW)
	MsgLeave        = byte(C.TSOCK_MSG_LEAVE)

	LockProducer  = int64(C.TSOCK_LOCK_PRODUCER)
	LockReader0   = int64(C.TSOCK_LOCK_READER0)
	LockDeviceMap = int64(C.TSOCK_LOCK_DEVICE_MAP)

	StateOpen   = uint32(C.TSOCK_STATE_OPEN)
	StateClosed = uint32(C.TSOCK_STATE_CLOSED)

	ReaderFree    = uint32(C.TSOCK_READER_FREE)
	ReaderActive  = uint32(C.TSOCK_READER_ACTIVE)
	ReaderEvicted = uint32(C.TSOCK_READER_EVICTED)

	FlagEpochEnd      = uint32(C.TSOCK_BATCH_EPOCH_END)
	PayloadHost       = uint32(C.TSOCK_PAYLOAD_HOST)
	PayloadHostDevice = uint32(C.TSOCK_PAYLOAD_HOST_DEVICE)

	PlacementHost   = uint32(C.TSOCK_PLACEMENT_HOST)
	PlacementPinned = uint32(C.TSOCK_PLACEMENT_PINNED)
	PlacementDevice = uint32(C.TSOCK_PLACEMENT_DEVICE)

	CUDAHandleBytes = int(C.TSOCK_CUDA_HANDLE_BYTES)
	CUDAUUIDBytes   = int(C.TSOCK_CUDA_UUID_BYTES)

	HeaderSize       = uintptr(C.sizeof_tsock_header)
	RosterEntrySize  = uintptr(C.sizeof_tsock_roster_entry)
	ReaderRecordSize = uintptr(C.sizeof_tsock_reader_record)
	SlotSize         = uintptr(C.sizeof_tsock_slot)
	ShmTensorSize    = uintptr(C.sizeof_tsock_shm_tensor)
	JoinRequestSize  = uintptr(C.sizeof_tsock_join_request)
	JoinReplySize    = uintptr(C.sizeof_tsock_join_reply)
)

// Status codes of tsock.h, for errors that cross the C ABI.
const (
	StatusOK           = int(C.TSOCK_OK)
	StatusAgain        = int(C.TSOCK_EAGAIN)
	StatusInval        = int(C.TSOCK_EINVAL)
	StatusHandle       = int(C.TSOCK_EHANDLE)
	StatusName         = int(C.TSOCK_ENAME)
	StatusNoEnt        = int(C.TSOCK_ENOENT)
	StatusExist        = int(C.TSOCK_EEXIST)
	StatusVersion      = int(C.TSOCK_EVERSION)
	StatusCorrupt      = int(C.TSOCK_ECORRUPT)
	StatusProducerGone = int(C.TSOCK_EPRODUCER_GONE)
	StatusClosed       = int(C.TSOCK_ECLOSED)
	StatusFull         = int(C.TSOCK_EFULL)
	StatusBackpressure = int(C.TSOCK_EBACKPRESSURE)
	StatusTimedOut     = int(C.TSOCK_ETIMEDOUT)
	StatusTooBig       = int(C.TSOCK_ETOOBIG)
	StatusDtype        = int(C.TSOCK_EDTYPE)
	StatusEvicted      = int(C.TSOCK_EEVICTED)
	StatusState        = int(C.TSOCK_ESTATE)
	StatusPerm         = int(C.TSOCK_EPERM)
	StatusSys          = int(C.TSOCK_ESYS)
	StatusForked       = int(C.TSOCK_EFORKED)
	StatusNoMem        = int(C.TSOCK_ENOMEM)
	StatusNoCUDA       = int(C.TSOCK_ENOCUDA)
	StatusNoDevice     = int(C.TSOCK_ENODEVICE)
)

// Dtypes of tsock.h.
const (
	DtypeBool     = int32(C.TSOCK_DTYPE_BOOL)
	DtypeInt8     = int32(C.TSOCK_DTYPE_INT8)
	DtypeInt16    = int32(C.TSOCK_DTYPE_INT16)
	DtypeInt32    = int32(C.TSOCK_DTYPE_INT32)
	DtypeInt64    = int32(C.TSOCK_DTYPE_INT64)
	DtypeUint8    = int32(C.TSOCK_DTYPE_UINT8)
	DtypeUint16   = int32(C.TSOCK_DTYPE_UINT16)
	DtypeUint32   = int32(C.TSOCK_DTYPE_UINT32)
	DtypeUint64   = int32(C.TSOCK_DTYPE_UINT64)
	DtypeFloat16  = int32(C.TSOCK_DTYPE_FLOAT16)
	DtypeBfloat16 = int32(C.TSOCK_DTYPE_BFLOAT16)
	DtypeFloat32  = int32(C.TSOCK_DTYPE_FLOAT32)
	DtypeFloat64  = int32(C.TSOCK_DTYPE_FLOAT64)
)

// Geometry is where each part of a segment lies.
type Geometry struct {
	RosterOffset, SlotsOffset, PayloadOffset, TotalBytes, SlotPayloadBytes uint64
}

// ComputeGeometry lays out a segment with the same rule the reader checks.
// ok is false for parameters outside the limits.
func ComputeGeometry(slots, readers uint32, slotBytes uint64) (g Geometry, ok bool) {
	var cg C.tsock_geometry
	if C.ring_geometry(C.uint32_t(slots), C.uint32_t(readers), C.uint64_t(slotBytes), &cg) != 0 {
		return g, false
	}
	return Geometry{
		RosterOffset:     uint64(cg.roster_offset),
		SlotsOffset:      uint64(cg.slots_offset),
		PayloadOffset:    uint64(cg.payload_offset),
		TotalBytes:       uint64(cg.total_bytes),
		SlotPayloadBytes: uint64(cg.slot_payload_bytes),
	}, true
}

// NameOK reports whether name is a valid channel name: 1..64 characters of
// [A-Za-z0-9._-], not "." or "..".
func NameOK(name string) bool {
	if len(name) == 0 || len(name) > NameMax {
		return false
	}
	for i := 0; i < len(name); i++ {
		if name[i] == 0 {
			return false
		}
	}
	cs := C.CString(name)
	defer C.free(unsafe.Pointer(cs))
	return C.ring_name_ok(cs) == 1
}

// DtypeSize is the element size of a dtype, 0 if unknown.
func DtypeSize(dtype int32) uint32 { return uint32(C.ring_dtype_size(C.int32_t(dtype))) }

// CheckTensor applies the tensor rule of layout.h: 0 when the descriptor
// fits a payload of payloadBytes, else StatusDtype or StatusTooBig.
func CheckTensor(t *ShmTensor, payloadBytes uint64) int {
	return int(C.ring_check_tensor(t.dtype, t.ndim, &t.shape[0], &t.strides[0], t.offset,
		t.nbytes, C.uint64_t(payloadBytes)))
}

// C64 and C32 are the cgo types of 64- and 32-bit layout fields.
type (
	C64 = C.uint64_t
	C32 = C.uint32_t
)

// Signed cgo field types.
type (
	C64s = C.int64_t
	C32s = C.int32_t
)

// headerFault is the rule a corrupt header broke (layout.h's
// tsock_header_fault).
type headerFault C.int

const headerBadMagic headerFault = C.TSOCK_HEADER_BAD_MAGIC

func (f headerFault) String() string { return C.GoString(C.tsock_layout_header_fault_str(C.int(f))) }

// checkHeader applies tsock_layout_check_header; why names the failing rule.
func checkHeader(h *Header, fileSize uint64) (status int, why headerFault) {
	var w C.int
	st := C.ring_check_header(h, C.uint64_t(fileSize), &w)
	return int(st), headerFault(w)
}

func statusString(st int) string { return C.GoString(C.ring_status_str(C.int(st))) }

// JoinAddress is the abstract Unix socket address (sun_path, with its
// leading NUL) of the join socket of a header whose join key is key.
func JoinAddress(key [16]byte) string {
	var path [C.TSOCK_JOIN_ADDR_MAX]C.char
	n := C.ring_join_address((*C.uint8_t)(unsafe.Pointer(&key[0])), &path[0])
	return C.GoStringN(&path[0], C.int(n))
}

package ring

import (
	"fmt"
	"os"
	"sync/atomic"
	"syscall"
	"unsafe"
)

// Params are the three choices that fix a segment's geometry.
type Params struct {
	Slots     uint32
	Readers   uint32
	SlotBytes uint64
}

// InitHeader writes a fresh segment's header: geometry, producer identity,
// state open, and layout_version last (release), after which readers may
// trust the rest. The segment must be zero-filled (a new file).
func (s *Segment) InitHeader(name string, pid int, createdNs uint64) {
	h := s.Header()
	g := s.Geometry
	h.magic = C64(Magic)
	h.header_size, h.slot_size, h.roster_entry_size = C32(HeaderSize), C32(SlotSize), C32(RosterEntrySize)
	h.slot_count, h.reader_capacity = C32(s.SlotCount), C32(s.Readers)
	h.slot_payload_bytes = C64(g.SlotPayloadBytes)
	h.roster_offset, h.slots_offset, h.payload_offset = C64(g.RosterOffset), C64(g.SlotsOffset), C64(g.PayloadOffset)
	h.total_bytes = C64(g.TotalBytes)
	h.producer_pid = C32s(int32(pid))
	h.producer_start_time = C64(ProcStartTime(pid))
	h.created_ns = C64(createdNs)
	n := copy(unsafe.Slice((*byte)(unsafe.Pointer(&h.name[0])), len(h.name)-1), name)
	_ = n
	s.SetState(StateOpen)
	atomic.StoreUint32(u32(&h.layout_version), LayoutVersion)
}

// HeaderInfo is the identity part of a header, for tools.
type HeaderInfo struct {
	ProducerPid       int32
	ProducerStartTime uint64
	CreatedNs         uint64
	Slots, Readers    uint32
	SlotPayloadBytes  uint64
	TotalBytes        uint64
}

// Info reads the header's identity fields.
func (s *Segment) Info() HeaderInfo {
	h := s.Header()
	return HeaderInfo{ProducerPid: int32(h.producer_pid), ProducerStartTime: uint64(h.producer_start_time),
		CreatedNs: uint64(h.created_ns), Slots: uint32(h.slot_count), Readers: uint32(h.reader_capacity),
		SlotPayloadBytes: uint64(h.slot_payload_bytes), TotalBytes: uint64(h.total_bytes)}
}

// CheckHeader validates the header page in buf (at least HeaderSize bytes)
// against a file of fileSize bytes, with the same rule as the C reader.
// It returns a tsock status and an error naming the problem.
func CheckHeader(buf []byte, fileSize uint64) (int, error) {
	if uint64(len(buf)) < uint64(HeaderSize) || fileSize < uint64(HeaderSize) {
		return StatusCorrupt, fmt.Errorf("%w: %d bytes", ErrTruncated, fileSize)
	}
	st, why := checkHeader((*Header)(unsafe.Pointer(&buf[0])), fileSize)
	h := (*Header)(unsafe.Pointer(&buf[0]))
	switch {
	case st == StatusOK:
		return st, nil
	case st == StatusAgain:
		return st, fmt.Errorf("segment is still being created")
	case st == StatusVersion:
		return st, fmt.Errorf("%w: segment has version %d, this build reads %d", ErrVersion,
			uint32(h.layout_version), LayoutVersion)
	case why == headerBadMagic:
		return st, ErrNotSegment
	default:
		return st, fmt.Errorf("%w: %v (file %d bytes, header says %d)", ErrTruncated, why, fileSize, uint64(h.total_bytes))
	}
}

// OpenSegment opens channel name read-only for inspection and checks its
// header. It takes no lock and claims no reader record. Like the reader, it
// never follows a symbolic link planted at the channel's path, and it does
// not block on a FIFO planted there.
func OpenSegment(name string) (*Segment, error) {
	if !NameOK(name) {
		return nil, Errorf(StatusName, "channel name %q is not 1..%d of [A-Za-z0-9._-]", name, NameMax)
	}
	f, err := os.OpenFile(ChannelPath(name), os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	seg, err := openChecked(f)
	if err != nil {
		f.Close()
		return nil, fmt.Errorf("channel %q: %w", name, err)
	}
	return seg, nil
}

func openChecked(f *os.File) (*Segment, error) {
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%w: %s is not a regular file", ErrNotSegment, f.Name())
	}
	buf := make([]byte, HeaderSize)
	if n, _ := f.ReadAt(buf, 0); n < len(buf) {
		return nil, fmt.Errorf("%w: %d bytes", ErrTruncated, st.Size())
	}
	if _, err := CheckHeader(buf, uint64(st.Size())); err != nil {
		return nil, err
	}
	h := (*Header)(unsafe.Pointer(&buf[0]))
	g, _ := ComputeGeometry(uint32(h.slot_count), uint32(h.reader_capacity), uint64(h.slot_payload_bytes))
	return MapSegment(f, g, uint32(h.slot_count), uint32(h.reader_capacity), false)
}

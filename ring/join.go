package ring

import (
	"unsafe"
)

// The join's messages (layout.h, "The join"), as Go values and their
// bytes in the layout of the C structs.

// JoinRequestMsg is what a reader sends to attach.
type JoinRequestMsg struct {
	Magic         uint64
	LayoutVersion uint32
	StartMode     uint32
	Reserved      uint64
}

// JoinReplyMsg is the producer's answer.
type JoinReplyMsg struct {
	Magic         uint64
	LayoutVersion uint32
	Status        int32
	Claim         uint64
	Start         uint64
	Index         uint32
	Flags         uint32
}

// NewJoinRequest is a valid request for start mode mode.
func NewJoinRequest(mode uint32) JoinRequestMsg {
	return JoinRequestMsg{Magic: JoinMagic, LayoutVersion: LayoutVersion, StartMode: mode}
}

// Bytes encodes the request.
func (m JoinRequestMsg) Bytes() []byte {
	var c JoinRequest
	c.magic, c.layout_version, c.start_mode, c.reserved = C64(m.Magic), C32(m.LayoutVersion),
		C32(m.StartMode), C64(m.Reserved)
	return append([]byte(nil), unsafe.Slice((*byte)(unsafe.Pointer(&c)), JoinRequestSize)...)
}

// ParseJoinRequest decodes a request of exactly the request's size.
func ParseJoinRequest(b []byte) (JoinRequestMsg, bool) {
	if uintptr(len(b)) != JoinRequestSize {
		return JoinRequestMsg{}, false
	}
	var c JoinRequest
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&c)), JoinRequestSize), b)
	return JoinRequestMsg{Magic: uint64(c.magic), LayoutVersion: uint32(c.layout_version),
		StartMode: uint32(c.start_mode), Reserved: uint64(c.reserved)}, true
}

// Bytes encodes the reply.
func (m JoinReplyMsg) Bytes() []byte {
	var c JoinReply
	c.magic, c.layout_version, c.status = C64(m.Magic), C32(m.LayoutVersion), C32s(m.Status)
	c.claim, c.start, c.index, c.flags = C64(m.Claim), C64(m.Start), C32(m.Index), C32(m.Flags)
	return append([]byte(nil), unsafe.Slice((*byte)(unsafe.Pointer(&c)), JoinReplySize)...)
}

// ParseJoinReply decodes a reply of exactly the reply's size.
func ParseJoinReply(b []byte) (JoinReplyMsg, bool) {
	if uintptr(len(b)) != JoinReplySize {
		return JoinReplyMsg{}, false
	}
	var c JoinReply
	copy(unsafe.Slice((*byte)(unsafe.Pointer(&c)), JoinReplySize), b)
	return JoinReplyMsg{Magic: uint64(c.magic), LayoutVersion: uint32(c.layout_version),
		Status: int32(c.status), Claim: uint64(c.claim), Start: uint64(c.start),
		Index: uint32(c.index), Flags: uint32(c.flags)}, true
}

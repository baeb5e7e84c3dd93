package ring_test

// Fuzz targets for the validation rules both sides apply: the header check
// (what a reader or tool accepts as a segment), the tensor check (what a
// reader accepts as a descriptor) and channel names (what may be opened
// under /dev/shm). Each compares the C rule of layout.h with an
// independent Go statement of the same rule (documented in
// docs/ARCHITECTURE.md), with exact big-integer arithmetic where C guards
// against overflow.
//
// The seed corpus runs in every `go test`; to fuzz:
//
//	go test -run '^$' -fuzz FuzzCheckHeader -fuzztime 60s ./ring

import (
	"encoding/binary"
	"math/big"
	"path/filepath"
	"regexp"
	"testing"
	"unsafe"

	"github.com/tsock/tsock/ring"
)

// Header field offsets (layout.h; pinned by TestLayoutPinned).
const (
	hOffMagic      = 0
	hOffVersion    = 8
	hOffHeaderSize = 12
	hOffSlotSize   = 16
	hOffEntrySize  = 20
	hOffSlotCount  = 24
	hOffReaders    = 28
	hOffSlotBytes  = 32
	hOffRosterOff  = 40
	hOffSlotsOff   = 48
	hOffPayloadOff = 56
	hOffTotal      = 64
)

// refCheckHeader is the header rule, restated: magic, then the version
// (0: being built), then struct sizes, then the geometry derived from the
// three parameters, then the file size.
func refCheckHeader(h []byte, fileSize uint64) int {
	if len(h) < int(ring.HeaderSize) || fileSize < uint64(ring.HeaderSize) {
		return ring.StatusCorrupt
	}
	le32 := func(o int) uint64 { return uint64(binary.LittleEndian.Uint32(h[o:])) }
	le64 := func(o int) uint64 { return binary.LittleEndian.Uint64(h[o:]) }
	if le64(hOffMagic) != ring.Magic {
		return ring.StatusCorrupt
	}
	switch v := le32(hOffVersion); {
	case v == 0:
		return ring.StatusAgain
	case v != uint64(ring.LayoutVersion):
		return ring.StatusVersion
	}
	if le32(hOffHeaderSize) != uint64(ring.HeaderSize) || le32(hOffSlotSize) != uint64(ring.SlotSize) ||
		le32(hOffEntrySize) != uint64(ring.RosterEntrySize) {
		return ring.StatusCorrupt
	}
	slots, readers, spb := le32(hOffSlotCount), le32(hOffReaders), le64(hOffSlotBytes)
	if slots < uint64(ring.MinSlots) || slots > uint64(ring.MaxSlots) || slots&(slots-1) != 0 ||
		readers < 1 || readers > uint64(ring.MaxReaders) || spb < 1 || spb > ring.MaxSlotBytes ||
		spb%ring.PageSize != 0 {
		return ring.StatusCorrupt
	}
	// Exact arithmetic: no overflow possible within the limits, but the
	// model should not rely on that.
	page := new(big.Int).SetUint64(ring.PageSize)
	alignUp := func(v *big.Int) *big.Int {
		r := new(big.Int).Add(v, new(big.Int).Sub(page, big.NewInt(1)))
		r.Div(r, page)
		return r.Mul(r, page)
	}
	b := func(v uint64) *big.Int { return new(big.Int).SetUint64(v) }
	ro := b(ring.PageSize)
	so := alignUp(new(big.Int).Add(ro, new(big.Int).Mul(b(readers), b(uint64(ring.RosterEntrySize)))))
	po := alignUp(new(big.Int).Add(so, new(big.Int).Mul(b(slots), b(uint64(ring.SlotSize)))))
	total := new(big.Int).Add(po, new(big.Int).Mul(b(slots), b(spb)))
	if ro.Cmp(b(le64(hOffRosterOff))) != 0 || so.Cmp(b(le64(hOffSlotsOff))) != 0 ||
		po.Cmp(b(le64(hOffPayloadOff))) != 0 || total.Cmp(b(le64(hOffTotal))) != 0 {
		return ring.StatusCorrupt
	}
	if total.Cmp(b(fileSize)) != 0 {
		return ring.StatusCorrupt
	}
	return ring.StatusOK
}

// validHeader is a header page of a real segment with the given geometry.
func validHeader(slots, readers uint32, spb uint64) ([]byte, uint64) {
	g, ok := ring.ComputeGeometry(slots, readers, spb)
	if !ok {
		panic("bad seed geometry")
	}
	h := make([]byte, ring.HeaderSize)
	binary.LittleEndian.PutUint64(h[hOffMagic:], ring.Magic)
	binary.LittleEndian.PutUint32(h[hOffVersion:], ring.LayoutVersion)
	binary.LittleEndian.PutUint32(h[hOffHeaderSize:], uint32(ring.HeaderSize))
	binary.LittleEndian.PutUint32(h[hOffSlotSize:], uint32(ring.SlotSize))
	binary.LittleEndian.PutUint32(h[hOffEntrySize:], uint32(ring.RosterEntrySize))
	binary.LittleEndian.PutUint32(h[hOffSlotCount:], slots)
	binary.LittleEndian.PutUint32(h[hOffReaders:], readers)
	binary.LittleEndian.PutUint64(h[hOffSlotBytes:], g.SlotPayloadBytes)
	binary.LittleEndian.PutUint64(h[hOffRosterOff:], g.RosterOffset)
	binary.LittleEndian.PutUint64(h[hOffSlotsOff:], g.SlotsOffset)
	binary.LittleEndian.PutUint64(h[hOffPayloadOff:], g.PayloadOffset)
	binary.LittleEndian.PutUint64(h[hOffTotal:], g.TotalBytes)
	return h, g.TotalBytes
}

// FuzzCheckHeader: arbitrary header bytes and file sizes. mode selects
// how the input is read: even, `patch` overwrites the start of a valid
// header (most mutations then hit one rule at a time); odd, `patch` is the
// whole header (zero-padded). sizeDelta moves the file size.
func FuzzCheckHeader(f *testing.F) {
	good, size := validHeader(8, 4, 8192)
	f.Add(uint8(0), []byte{}, int64(0))
	f.Add(uint8(0), good[:72], int64(0))
	f.Add(uint8(0), good[:72], int64(4096))
	f.Add(uint8(0), good[:72], -int64(size))
	f.Add(uint8(1), good, int64(0))
	f.Add(uint8(1), []byte("TSOCKSHM"), int64(0))
	f.Add(uint8(2), []byte{0x54, 0x53, 0x4f, 0x43, 0x4b, 0x53, 0x48, 0x4d, 0, 0, 0, 0}, int64(0)) // being built
	f.Add(uint8(4), append(append([]byte{}, good[:24]...), 0xff, 0xff, 0xff, 0xff), int64(0))
	f.Add(uint8(6), []byte{}, int64(0))
	f.Fuzz(func(t *testing.T, mode uint8, patch []byte, sizeDelta int64) {
		// Base geometry from the mode's upper bits: small and large rings.
		geoms := [][3]uint64{{8, 4, 8192}, {2, 1, 1}, {65536, 1024, 4096}, {16, 64, 1 << 20}}
		gm := geoms[(mode>>1)%4]
		h, fileSize := validHeader(uint32(gm[0]), uint32(gm[1]), gm[2])
		if mode&1 == 1 {
			h = make([]byte, ring.HeaderSize)
		}
		copy(h, patch)
		fileSize = uint64(int64(fileSize) + sizeDelta)
		st, err := ring.CheckHeader(h, fileSize)
		want := refCheckHeader(h, fileSize)
		if st != want {
			t.Fatalf("CheckHeader = %d (%v), the rule says %d", st, err, want)
		}
		if (st == ring.StatusOK) != (err == nil) {
			t.Fatalf("status %d with error %v", st, err)
		}
		// A short buffer is refused, never read past its end.
		if len(patch) < int(ring.HeaderSize) {
			if st2, _ := ring.CheckHeader(patch, fileSize); st2 != ring.StatusCorrupt {
				t.Fatalf("a %d-byte buffer gave status %d", len(patch), st2)
			}
		}
		if st != ring.StatusOK {
			return
		}
		// Accepted: every region lies inside the file, in order.
		le64 := func(o int) uint64 { return binary.LittleEndian.Uint64(h[o:]) }
		slots := uint64(binary.LittleEndian.Uint32(h[hOffSlotCount:]))
		readers := uint64(binary.LittleEndian.Uint32(h[hOffReaders:]))
		ro, so, po := le64(hOffRosterOff), le64(hOffSlotsOff), le64(hOffPayloadOff)
		if ro < uint64(ring.HeaderSize) || ro+readers*uint64(ring.RosterEntrySize) > so ||
			so+slots*uint64(ring.SlotSize) > po || po+slots*le64(hOffSlotBytes) != fileSize {
			t.Fatalf("accepted a header whose regions overlap or leave the file: %x", h[:72])
		}
	})
}

// refCheckTensor is the tensor rule, restated with exact integers: known
// dtype, ndim in 0..8, offset aligned to the element size, [offset,
// offset+nbytes) inside the payload; for each dimension in order: negative
// extent or stride is a dtype error, a zero extent makes the tensor empty,
// an index span beyond 2^64-1 is too big; a non-empty tensor's furthest
// element must end inside nbytes.
func refCheckTensor(dtype, ndim int32, shape, strides []int64, offset, nbytes, payload uint64) int {
	sizes := map[int32]uint64{1: 1, 2: 1, 6: 1, 3: 2, 7: 2, 10: 2, 11: 2, 4: 4, 8: 4, 12: 4, 5: 8, 9: 8, 13: 8}
	item, ok := sizes[dtype]
	if !ok || ndim < 0 || ndim > int32(ring.MaxDims) {
		return ring.StatusDtype
	}
	if offset%item != 0 {
		return ring.StatusDtype
	}
	b := func(v uint64) *big.Int { return new(big.Int).SetUint64(v) }
	if new(big.Int).Add(b(offset), b(nbytes)).Cmp(b(payload)) > 0 {
		return ring.StatusTooBig
	}
	max64 := b(^uint64(0))
	last := new(big.Int)
	empty := false
	for i := 0; i < int(ndim); i++ {
		if shape[i] < 0 || strides[i] < 0 {
			return ring.StatusDtype
		}
		if shape[i] == 0 {
			empty = true
			continue
		}
		last.Add(last, new(big.Int).Mul(big.NewInt(shape[i]-1), big.NewInt(strides[i])))
		if last.Cmp(max64) > 0 {
			return ring.StatusTooBig
		}
	}
	if empty {
		return ring.StatusOK
	}
	need := new(big.Int).Mul(new(big.Int).Add(last, big.NewInt(1)), b(item))
	if need.Cmp(b(nbytes)) > 0 {
		return ring.StatusTooBig
	}
	return ring.StatusOK
}

// shmTensor builds a descriptor from raw values (its fields are
// unexported cgo fields: write them at their offsets).
func shmTensor(dtype, ndim int32, shape, strides []int64, offset, nbytes uint64) *ring.ShmTensor {
	var d ring.ShmTensor
	raw := unsafe.Slice((*byte)(unsafe.Pointer(&d)), ring.ShmTensorSize)
	binary.LittleEndian.PutUint32(raw[ring.TensorOffDtype:], uint32(dtype))
	binary.LittleEndian.PutUint32(raw[ring.TensorOffNdim:], uint32(ndim))
	binary.LittleEndian.PutUint64(raw[ring.TensorOffOffset:], offset)
	binary.LittleEndian.PutUint64(raw[ring.TensorOffNbytes:], nbytes)
	for i := 0; i < ring.MaxDims; i++ {
		binary.LittleEndian.PutUint64(raw[ring.TensorOffShape+uintptr(8*i):], uint64(shape[i]))
		binary.LittleEndian.PutUint64(raw[ring.TensorOffStrides+uintptr(8*i):], uint64(strides[i]))
	}
	return &d
}

// FuzzCheckTensor: arbitrary descriptors against arbitrary payload sizes;
// Tensor.Fill (the producer's path) on the same shape never panics and
// never produces a descriptor the rule rejects.
func FuzzCheckTensor(f *testing.F) {
	le := func(vs ...int64) []byte {
		out := make([]byte, 8*len(vs))
		for i, v := range vs {
			binary.LittleEndian.PutUint64(out[8*i:], uint64(v))
		}
		return out
	}
	f.Add(int32(ring.DtypeFloat32), int32(2), le(4, 8), le(8, 1), uint64(0), uint64(128), uint64(4096))
	f.Add(int32(ring.DtypeUint8), int32(1), le(4097), le(1), uint64(0), uint64(4097), uint64(4096))
	f.Add(int32(ring.DtypeInt64), int32(1), le(2), le(1), uint64(4), uint64(16), uint64(64))
	f.Add(int32(ring.DtypeInt16), int32(3), le(0, -1, 5), le(1, 1, 1), uint64(0), uint64(0), uint64(64))
	f.Add(int32(ring.DtypeUint8), int32(2), le(1<<62, 5), le(4, 1<<62), uint64(0), uint64(64), uint64(64))
	f.Add(int32(ring.DtypeFloat64), int32(9), le(), le(), uint64(0), uint64(0), uint64(0))
	f.Add(int32(0), int32(1), le(1), le(1), uint64(0), uint64(1), uint64(1))
	f.Add(int32(ring.DtypeUint8), int32(1), le(3), le(0), ^uint64(0), uint64(2), ^uint64(0))
	f.Fuzz(func(t *testing.T, dtype, ndim int32, shapeB, strideB []byte, offset, nbytes, payload uint64) {
		var shape, strides [ring.MaxDims]int64
		for i := 0; i < ring.MaxDims; i++ {
			if len(shapeB) >= 8*(i+1) {
				shape[i] = int64(binary.LittleEndian.Uint64(shapeB[8*i:]))
			}
			if len(strideB) >= 8*(i+1) {
				strides[i] = int64(binary.LittleEndian.Uint64(strideB[8*i:]))
			}
		}
		got := ring.CheckTensor(shmTensor(dtype, ndim, shape[:], strides[:], offset, nbytes), payload)
		want := refCheckTensor(dtype, ndim, shape[:], strides[:], offset, nbytes, payload)
		if got != want {
			t.Fatalf("CheckTensor(dtype %d ndim %d shape %v strides %v offset %d nbytes %d payload %d) = %d, the rule says %d",
				dtype, ndim, shape, strides, offset, nbytes, payload, got, want)
		}
		// The producer's path: Fill computes strides and nbytes itself.
		nd := int(ndim)
		if nd < 0 {
			nd = 0
		}
		if nd > ring.MaxDims+1 {
			nd = ring.MaxDims + 1
		}
		ext := make([]int64, nd)
		for i := range ext {
			if i < ring.MaxDims {
				ext[i] = shape[i]
			}
		}
		tn := ring.Tensor{Dtype: dtype, Shape: ext, Offset: offset}
		if len(strideB) > 0 && nd <= ring.MaxDims {
			tn.Strides = append([]int64(nil), strides[:nd]...)
		}
		var d ring.ShmTensor
		if st, err := tn.Fill(&d, payload); st == ring.StatusOK {
			if ring.CheckTensor(&d, payload) != ring.StatusOK {
				t.Fatalf("Fill accepted %+v but the rule rejects its descriptor", tn)
			}
		} else if err == nil {
			t.Fatalf("Fill returned status %d without an error", st)
		}
	})
}

var nameRule = regexp.MustCompile(`^[A-Za-z0-9._-]{1,64}$`)

// FuzzNameOK: a name is valid exactly when it matches the rule, and a
// valid name always names a file directly inside /dev/shm.
func FuzzNameOK(f *testing.F) {
	for _, s := range []string{"a", ".", "..", "...", "a/b", "../etc/passwd", "a\x00", "tsock", "x.y-z_0",
		"/", "é", "a b", string(make([]byte, 65))} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, name string) {
		want := nameRule.MatchString(name) && name != "." && name != ".."
		if got := ring.NameOK(name); got != want {
			t.Fatalf("NameOK(%q) = %v, the rule says %v", name, got, want)
		}
		if !want {
			return
		}
		p := ring.ChannelPath(name)
		if filepath.Dir(p) != ring.ShmDir || filepath.Clean(p) != p || filepath.Base(p) != ring.ShmPrefix+name {
			t.Fatalf("valid name %q leaves %s: %s", name, ring.ShmDir, p)
		}
	})
}

package ring_test

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/ring"
)

func TestNameOK(t *testing.T) {
	valid := []string{"a", "A", "0", "train-loader_1.v2", "..a", ".a", "a..", "-", "_",
		strings.Repeat("x", 64), strings.Repeat("é", 0) + "z"}
	for _, n := range valid {
		assert.True(t, ring.NameOK(n), "%q should be valid", n)
	}
	invalid := []string{"", ".", "..", strings.Repeat("x", 65), strings.Repeat("y", 1000),
		"a/b", "/a", "a/", "../a", "a\x00b", "\x00", "a b", "a\n", "é", "a:b", "a*", "tsock~"}
	for _, n := range invalid {
		assert.False(t, ring.NameOK(n), "%q should be invalid", n)
	}
	assert.Equal(t, "/dev/shm/tsock.abc", ring.ChannelPath("abc"))
}

func TestDtypeSize(t *testing.T) {
	want := map[int32]uint32{
		ring.DtypeBool: 1, ring.DtypeInt8: 1, ring.DtypeUint8: 1,
		ring.DtypeInt16: 2, ring.DtypeUint16: 2, ring.DtypeFloat16: 2, ring.DtypeBfloat16: 2,
		ring.DtypeInt32: 4, ring.DtypeUint32: 4, ring.DtypeFloat32: 4,
		ring.DtypeInt64: 8, ring.DtypeUint64: 8, ring.DtypeFloat64: 8,
	}
	for d, n := range want {
		assert.Equal(t, n, ring.DtypeSize(d), "dtype %d", d)
	}
	for _, d := range []int32{0, -1, 14, 100, 1 << 30} {
		assert.Zero(t, ring.DtypeSize(d), "dtype %d", d)
	}
}

func TestTensorFill(t *testing.T) {
	const payload = 4096
	type tc struct {
		name string
		t    ring.Tensor
		st   int
	}
	cases := []tc{
		{"contiguous 1d", ring.Tensor{Dtype: ring.DtypeFloat32, Shape: []int64{1024}}, ring.StatusOK},
		{"contiguous fills payload", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{64, 64}}, ring.StatusOK},
		{"one byte too many", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{4097}}, ring.StatusTooBig},
		{"scalar", ring.Tensor{Dtype: ring.DtypeFloat64, Shape: nil}, ring.StatusOK},
		{"scalar at end", ring.Tensor{Dtype: ring.DtypeFloat64, Offset: payload - 8}, ring.StatusOK},
		{"scalar past end", ring.Tensor{Dtype: ring.DtypeFloat64, Offset: payload}, ring.StatusTooBig},
		{"offset plus size past end", ring.Tensor{Dtype: ring.DtypeInt32, Shape: []int64{2}, Offset: payload - 4}, ring.StatusTooBig},
		{"zero size", ring.Tensor{Dtype: ring.DtypeInt32, Shape: []int64{0, 5}}, ring.StatusOK},
		{"zero size at end", ring.Tensor{Dtype: ring.DtypeInt32, Shape: []int64{7, 0}, Offset: payload}, ring.StatusOK},
		{"zero size past end", ring.Tensor{Dtype: ring.DtypeInt32, Shape: []int64{0}, Offset: payload + 4}, ring.StatusTooBig},
		{"zero size huge other dim", ring.Tensor{Dtype: ring.DtypeInt64, Shape: []int64{0, 1 << 62}}, ring.StatusOK},
		{"strided", ring.Tensor{Dtype: ring.DtypeFloat32, Shape: []int64{4, 4}, Strides: []int64{16, 2}, Nbytes: (3*16 + 3*2 + 1) * 4}, ring.StatusOK},
		{"strided transposed", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{3, 5}, Strides: []int64{1, 3}, Nbytes: 15}, ring.StatusOK},
		{"strided broadcast", ring.Tensor{Dtype: ring.DtypeInt64, Shape: []int64{1000, 3}, Strides: []int64{0, 1}, Nbytes: 24}, ring.StatusOK},
		{"strided nbytes short", ring.Tensor{Dtype: ring.DtypeFloat32, Shape: []int64{4, 4}, Strides: []int64{16, 2}, Nbytes: (3*16 + 3*2 + 1) * 3}, ring.StatusTooBig},
		{"strided past payload", ring.Tensor{Dtype: ring.DtypeFloat32, Shape: []int64{100, 4}, Strides: []int64{16, 1}, Nbytes: payload + 4}, ring.StatusTooBig},
		{"negative stride", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{4}, Strides: []int64{-1}, Nbytes: 4}, ring.StatusDtype},
		{"strides length mismatch", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{4}, Strides: []int64{1, 1}, Nbytes: 4}, ring.StatusDtype},
		{"negative extent", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{-1}}, ring.StatusDtype},
		{"negative extent 2d", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{4, -2}}, ring.StatusDtype},
		{"overflow 1<<62 int64", ring.Tensor{Dtype: ring.DtypeInt64, Shape: []int64{1 << 62}}, ring.StatusTooBig},
		{"overflow 1<<62 uint8", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1 << 62}}, ring.StatusTooBig},
		{"overflow wraps to 0", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1 << 32, 1 << 32}}, ring.StatusTooBig},
		{"overflow wraps small", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{2, 1 << 62, 5}}, ring.StatusTooBig},
		{"overflow strides", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{3, 3}, Strides: []int64{1 << 62, 1 << 62}, Nbytes: 16}, ring.StatusTooBig},
		{"max int64 extent", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1<<63 - 1}}, ring.StatusTooBig},
		{"misaligned offset", ring.Tensor{Dtype: ring.DtypeInt32, Shape: []int64{2}, Offset: 2}, ring.StatusDtype},
		{"misaligned offset f64", ring.Tensor{Dtype: ring.DtypeFloat64, Shape: []int64{2}, Offset: 12}, ring.StatusDtype},
		{"aligned odd offset u8", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{2}, Offset: 3}, ring.StatusOK},
		{"offset past payload", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1}, Offset: payload + 8}, ring.StatusTooBig},
		{"offset near 2^64", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1}, Offset: ^uint64(0) - 7}, ring.StatusTooBig},
		{"nbytes near 2^64", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1}, Offset: 8, Nbytes: ^uint64(0) - 3}, ring.StatusTooBig},
		{"unknown dtype", ring.Tensor{Dtype: 99, Shape: []int64{1}}, ring.StatusDtype},
		{"dtype 0", ring.Tensor{Dtype: 0, Shape: []int64{1}}, ring.StatusDtype},
		{"8 dims", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{2, 2, 2, 2, 2, 2, 2, 2}}, ring.StatusOK},
		{"9 dims", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{1, 1, 1, 1, 1, 1, 1, 1, 1}}, ring.StatusDtype},
		{"explicit nbytes larger than needed", ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{4}, Nbytes: 100}, ring.StatusOK},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			var d ring.ShmTensor
			st, err := c.t.Fill(&d, payload)
			assert.Equal(t, c.st, st, "%+v: %v", c.t, err)
			if c.st == ring.StatusOK {
				assert.NoError(t, err)
				assert.Equal(t, ring.StatusOK, ring.CheckTensor(&d, payload))
			} else {
				assert.Error(t, err)
			}
		})
	}
}

// TestTensorFillStridedDefaultNbytes: Nbytes 0 means "computed from the
// shape", for strided tensors too.
func TestTensorFillStridedDefaultNbytes(t *testing.T) {
	var d ring.ShmTensor
	tn := ring.Tensor{Dtype: ring.DtypeFloat32, Shape: []int64{4, 4}, Strides: []int64{16, 2}}
	st, err := tn.Fill(&d, 4096)
	require.Equal(t, ring.StatusOK, st, "%v", err)
	// The descriptor now spans exactly the addressed elements: shrinking the
	// payload below that span must fail.
	assert.Equal(t, ring.StatusOK, ring.CheckTensor(&d, (3*16+3*2+1)*4))
	assert.Equal(t, ring.StatusTooBig, ring.CheckTensor(&d, (3*16+3*2+1)*4-1))

	tn = ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{0, 4}, Strides: []int64{4, 1}, Offset: 4096}
	st, err = tn.Fill(&d, 4096)
	assert.Equal(t, ring.StatusOK, st, "%v", err)
	tn = ring.Tensor{Dtype: ring.DtypeUint8, Shape: []int64{3, 1 << 62}, Strides: []int64{1 << 62, 1}}
	st, _ = tn.Fill(&d, 4096)
	assert.Equal(t, ring.StatusTooBig, st)
}

// segmentBuf builds a valid header for a file of the returned size.
func segmentBuf(t *testing.T, slots, readers uint32, slotBytes uint64) ([]byte, uint64) {
	t.Helper()
	g, ok := ring.ComputeGeometry(slots, readers, slotBytes)
	require.True(t, ok)
	f, err := os.Create(filepath.Join(t.TempDir(), "seg"))
	require.NoError(t, err)
	t.Cleanup(func() { f.Close() })
	require.NoError(t, f.Truncate(int64(g.TotalBytes)))
	seg, err := ring.MapSegment(f, g, slots, readers, true)
	require.NoError(t, err)
	seg.InitHeader("check-header", os.Getpid(), 42)
	buf := make([]byte, ring.HeaderSize)
	copy(buf, unsafe.Slice((*byte)(unsafe.Pointer(seg.Header())), ring.HeaderSize))
	require.NoError(t, seg.Unmap())
	return buf, g.TotalBytes
}

func TestCheckHeader(t *testing.T) {
	good, size := segmentBuf(t, 8, 4, 8192)
	st, err := ring.CheckHeader(good, size)
	require.NoError(t, err)
	require.Equal(t, ring.StatusOK, st)

	put32 := func(b []byte, off int, v uint32) []byte {
		c := append([]byte(nil), b...)
		binary.LittleEndian.PutUint32(c[off:], v)
		return c
	}
	put64 := func(b []byte, off int, v uint64) []byte {
		c := append([]byte(nil), b...)
		binary.LittleEndian.PutUint64(c[off:], v)
		return c
	}
	zero := make([]byte, ring.HeaderSize)
	garbage := make([]byte, ring.HeaderSize)
	for i := range garbage {
		garbage[i] = byte(i*131 + 7)
	}
	// Offsets of layout.h (pinned by TestLayoutPinned / TestLayoutMatchesC).
	const (
		offVersion    = 8
		offHeaderSize = 12
		offSlotSize   = 16
		offSlotCount  = 24
		offReaders    = 28
		offSlotBytes  = 32
		offPayloadOff = 56
		offTotal      = 64
	)
	cases := []struct {
		name   string
		buf    []byte
		size   uint64
		st     int
		target error
	}{
		{"zeros", zero, size, ring.StatusCorrupt, ring.ErrNotSegment},
		{"garbage", garbage, size, ring.StatusCorrupt, ring.ErrNotSegment},
		{"bad magic", put64(good, 0, ring.Magic+1), size, ring.StatusCorrupt, ring.ErrNotSegment},
		{"truncated buffer", good[:100], size, ring.StatusCorrupt, ring.ErrTruncated},
		{"empty buffer", nil, size, ring.StatusCorrupt, ring.ErrTruncated},
		{"tiny file", good, 100, ring.StatusCorrupt, ring.ErrTruncated},
		{"file shorter than header says", good, size - 4096, ring.StatusCorrupt, ring.ErrTruncated},
		{"file longer than header says", good, size + 4096, ring.StatusCorrupt, ring.ErrTruncated},
		{"next version", put32(good, offVersion, ring.LayoutVersion+1), size, ring.StatusVersion, ring.ErrVersion},
		{"version max", put32(good, offVersion, ^uint32(0)), size, ring.StatusVersion, ring.ErrVersion},
		{"being built", put32(good, offVersion, 0), size, ring.StatusAgain, nil},
		{"header size", put32(good, offHeaderSize, 2048), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"slot size", put32(good, offSlotSize, 64), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"slot count not a power of two", put32(good, offSlotCount, 6), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"slot count 0", put32(good, offSlotCount, 0), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"more slots than the file", put32(good, offSlotCount, 16), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"readers 0", put32(good, offReaders, 0), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"slot bytes unaligned", put64(good, offSlotBytes, 8191), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"payload offset", put64(good, offPayloadOff, 4096), size, ring.StatusCorrupt, ring.ErrTruncated},
		{"total bytes", put64(good, offTotal, size+4096), size + 4096, ring.StatusCorrupt, ring.ErrTruncated},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			st, err := ring.CheckHeader(c.buf, c.size)
			assert.Equal(t, c.st, st)
			require.Error(t, err)
			if c.target != nil {
				assert.ErrorIs(t, err, c.target)
			}
		})
	}
}

// A segment whose size is not the header's is reported as truncated once,
// with both sizes: the message an operator reads in `tsock ls` and errors.
func TestCheckHeaderFileSizeMessage(t *testing.T) {
	good, size := segmentBuf(t, 8, 4, 8192)
	st, err := ring.CheckHeader(good, size-4096)
	assert.Equal(t, ring.StatusCorrupt, st)
	require.ErrorIs(t, err, ring.ErrTruncated)
	want := fmt.Sprintf("segment truncated or inconsistent: the file's size differs from the header's "+
		"(file %d bytes, header says %d)", size-4096, size)
	assert.Equal(t, want, err.Error())
	assert.Equal(t, 1, strings.Count(err.Error(), "truncated"), err.Error())
}

func TestOpenSegment(t *testing.T) {
	name := fmt.Sprintf("ringtest-%d-%d", os.Getpid(), time.Now().UnixNano()%1e9)
	path := ring.ChannelPath(name)
	t.Cleanup(func() { os.Remove(path) })

	_, err := ring.OpenSegment(name)
	assert.ErrorIs(t, err, os.ErrNotExist)

	require.NoError(t, os.WriteFile(path, []byte("not a segment"), 0o600))
	_, err = ring.OpenSegment(name)
	assert.ErrorIs(t, err, ring.ErrTruncated)

	g, ok := ring.ComputeGeometry(4, 2, 4096)
	require.True(t, ok)
	f, err := os.OpenFile(path, os.O_RDWR|os.O_TRUNC, 0o600)
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(g.TotalBytes)))
	_, err = ring.OpenSegment(name)
	assert.ErrorIs(t, err, ring.ErrNotSegment)

	w, err := ring.MapSegment(f, g, 4, 2, true)
	require.NoError(t, err)
	defer w.Unmap()
	w.InitHeader(name, os.Getpid(), 7)
	w.StorePublished(3)
	w.SetEpoch(1)

	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.File.Close()
	defer seg.Unmap()
	info := seg.Info()
	assert.Equal(t, int32(os.Getpid()), info.ProducerPid)
	assert.Equal(t, ring.ProcStartTime(os.Getpid()), info.ProducerStartTime)
	assert.Equal(t, uint64(7), info.CreatedNs)
	assert.Equal(t, uint32(4), info.Slots)
	assert.Equal(t, uint32(2), info.Readers)
	assert.Equal(t, uint64(4096), info.SlotPayloadBytes)
	assert.Equal(t, g.TotalBytes, info.TotalBytes)
	assert.Equal(t, uint64(3), seg.Published())
	assert.Equal(t, uint64(1), seg.Epoch())
	assert.Equal(t, ring.StateOpen, seg.State())
	assert.True(t, seg.StillNamed(path))
	locked, err := seg.ProducerLocked()
	require.NoError(t, err)
	assert.False(t, locked, "nobody took the producer lock")

	// Slot arithmetic: seq maps to seq mod slots, payloads do not overlap.
	assert.Equal(t, uint64(1), seg.SlotIndex(5))
	addr := func(s *ring.Slot) uintptr { return uintptr(unsafe.Pointer(s)) }
	assert.Equal(t, addr(seg.SlotAt(1)), addr(seg.SlotAt(5)))
	assert.Equal(t, ring.SlotSize, addr(seg.SlotAt(2))-addr(seg.SlotAt(1)))
	assert.Equal(t, uintptr(unsafe.Pointer(seg.Header()))+uintptr(g.SlotsOffset), addr(seg.SlotAt(0)))
	p1, p2 := seg.Payload(1), seg.Payload(2)
	assert.Len(t, p1, 4096)
	assert.Equal(t, uintptr(4096), uintptr(unsafe.Pointer(&p2[0]))-uintptr(unsafe.Pointer(&p1[0])))
	assert.Equal(t, uintptr(unsafe.Pointer(&p1[0])), uintptr(unsafe.Pointer(&seg.Payload(5)[0])))
}

func TestSlotWriteRead(t *testing.T) {
	g, ok := ring.ComputeGeometry(4, 2, 4096)
	require.True(t, ok)
	f, err := os.Create(filepath.Join(t.TempDir(), "seg"))
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(g.TotalBytes)))
	seg, err := ring.MapSegment(f, g, 4, 2, true)
	require.NoError(t, err)
	defer seg.Unmap()

	var descs [2]ring.ShmTensor
	ts := []ring.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{10}}, {Dtype: ring.DtypeInt64, Shape: []int64{2}, Offset: 16}}
	for i := range ts {
		st, err := ts[i].Fill(&descs[i], 32)
		require.Equal(t, ring.StatusOK, st, "%v", err)
	}
	seg.BeginSlot(6)
	assert.Zero(t, seg.SlotStamp(6))
	seg.WriteSlot(6, &ring.SlotContents{Epoch: 2, Index: 9, Flags: 0, Tensors: ts, Meta: []byte("hi"),
		PayloadBytes: 32, PublishNs: 123}, descs[:])
	assert.Equal(t, uint64(7), seg.SlotStamp(6))
	assert.Equal(t, uint64(7), seg.SlotStamp(2), "same slot")
	h := seg.ReadSlotHead(6)
	assert.Equal(t, ring.SlotHead{Stamp: 7, Epoch: 2, Index: 9, NTensors: 2, PayloadBytes: 32, PublishNs: 123}, h)
}

func TestClaimWord(t *testing.T) {
	c := ring.MakeClaim(12345, ring.ReaderActive)
	assert.Equal(t, uint64(12345), ring.ClaimGen(c))
	assert.Equal(t, ring.ReaderActive, ring.ClaimState(c))
	assert.Equal(t, uint64(12345<<8|1), c)
	big := ring.MakeClaim(1<<56-1, ring.ReaderEvicted)
	assert.Equal(t, uint64(1<<56-1), ring.ClaimGen(big))
	assert.Equal(t, ring.ReaderEvicted, ring.ClaimState(big))
}

func TestErrors(t *testing.T) {
	err := ring.Errorf(ring.StatusBackpressure, "ring full at %d", 5)
	assert.EqualError(t, err, "ring full at 5")
	assert.ErrorIs(t, err, ring.Status(ring.StatusBackpressure))
	assert.NotErrorIs(t, err, ring.Status(ring.StatusTimedOut))
	assert.ErrorIs(t, fmt.Errorf("wrapped: %w", err), ring.Status(ring.StatusBackpressure))
	assert.Equal(t, ring.StatusBackpressure, ring.StatusOf(err))
	assert.Equal(t, ring.StatusOK, ring.StatusOf(nil))
	assert.Equal(t, ring.StatusClosed, ring.StatusOf(ring.Status(ring.StatusClosed)))
	assert.Equal(t, ring.StatusSys, ring.StatusOf(errors.New("other")))
	assert.Equal(t, "producer gone", ring.Status(ring.StatusProducerGone).Error())
	assert.Equal(t, "unknown status", ring.Status(-99).Error())
	assert.Equal(t, "ok", ring.Status(0).Error())
	for st := ring.StatusNoDevice; st <= ring.StatusOK; st++ {
		assert.NotEqual(t, "unknown status", ring.Status(st).Error(), "status %d", st)
	}
}

func TestByteLocks(t *testing.T) {
	path := filepath.Join(t.TempDir(), "locks")
	require.NoError(t, os.WriteFile(path, make([]byte, 16), 0o600))
	a, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer a.Close()
	b, err := os.OpenFile(path, os.O_RDWR, 0)
	require.NoError(t, err)
	defer b.Close()

	require.NoError(t, ring.LockByte(a, 3))
	locked, err := ring.ByteLocked(b, 3)
	require.NoError(t, err)
	assert.True(t, locked, "b sees a's lock")
	locked, err = ring.ByteLocked(a, 3)
	require.NoError(t, err)
	assert.False(t, locked, "a's own lock does not conflict with a")
	locked, err = ring.ByteLocked(b, 4)
	require.NoError(t, err)
	assert.False(t, locked, "only one byte is locked")
	assert.ErrorIs(t, ring.LockByte(b, 3), ring.ErrLocked)
	require.NoError(t, ring.LockByte(b, 4), "neighbouring byte is free")
	require.NoError(t, ring.LockByte(a, 3), "relocking the same description is fine")

	require.NoError(t, ring.UnlockByte(a, 3))
	locked, err = ring.ByteLocked(b, 3)
	require.NoError(t, err)
	assert.False(t, locked)
	require.NoError(t, ring.LockByte(a, 3))
	// Closing the description drops its locks (as a process death does).
	require.NoError(t, a.Close())
	require.NoError(t, ring.LockByte(b, 3))
}

func TestFutex(t *testing.T) {
	word := new(uint32)
	start := time.Now()
	ring.FutexWait(word, 1, 20*time.Second) // value differs: returns at once
	assert.Less(t, time.Since(start), 5*time.Second)

	start = time.Now()
	ring.FutexWait(word, 0, 30*time.Millisecond)
	assert.GreaterOrEqual(t, time.Since(start), 25*time.Millisecond)

	done := make(chan time.Duration)
	go func() {
		s := time.Now()
		for atomic.LoadUint32(word) == 0 {
			ring.FutexWait(word, 0, 5*time.Second)
		}
		done <- time.Since(s)
	}()
	time.Sleep(20 * time.Millisecond)
	atomic.StoreUint32(word, 1)
	ring.FutexWakeAll(word)
	select {
	case d := <-done:
		assert.Less(t, d, 4*time.Second)
	case <-time.After(5 * time.Second):
		t.Fatal("FutexWakeAll did not wake the waiter")
	}
}

func TestProcStartTime(t *testing.T) {
	st := ring.ProcStartTime(os.Getpid())
	assert.NotZero(t, st)
	assert.Equal(t, st, ring.ProcStartTime(os.Getpid()))
	assert.LessOrEqual(t, ring.ProcStartTime(1), st, "init started first")
	assert.Zero(t, ring.ProcStartTime(-5))
	assert.Zero(t, ring.ProcStartTime(1<<30))
	a := ring.MonotonicNs()
	time.Sleep(time.Millisecond)
	assert.Greater(t, ring.MonotonicNs(), a)
}

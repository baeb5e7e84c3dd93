package reader_test

// FuzzAttachAcquire feeds the C reader (through the Go wrapper) segment
// files it did not make: a valid-ish header with fuzzed bytes patched in,
// a fuzzed file size, fuzzed slots, and then a fuzzed script of producer
// actions (publish fuzzed slots, overwrite stamps, close, die, overwrite
// the reader's own claim) interleaved with Acquire(0) and Release. It
// checks that attach and acquire never crash or hang, return only
// documented statuses, and agree with the rules: attach with the header
// check of layout.h, a handed-out batch with exactly what was written
// (descriptors and payload bytes at the right place), a rejected batch
// with the tensor rule, the end of the stream with what the producer did.
//
// The seed corpus (and testdata/fuzz/FuzzAttachAcquire) runs in every
// `go test`; to fuzz:
//
//	go test -run '^$' -fuzz FuzzAttachAcquire -fuzztime 120s ./reader

import (
	"encoding/binary"
	"fmt"
	"math/rand/v2"
	"os"
	"regexp"
	"strconv"
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"github.com/tsock/tsock/internal/readers"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// stream hands out fuzz bytes; past the end it returns zeros.
type stream struct {
	b []byte
	i int
}

func (s *stream) u8() byte {
	if s.i >= len(s.b) {
		return 0
	}
	v := s.b[s.i]
	s.i++
	return v
}

func (s *stream) u16() uint16 { return uint16(s.u8()) | uint16(s.u8())<<8 }

func (s *stream) u64() uint64 {
	return uint64(s.u16()) | uint64(s.u16())<<16 | uint64(s.u16())<<32 | uint64(s.u16())<<48
}

// patByte is the payload byte at file offset o: data handed out must equal
// the pattern of exactly the bytes the descriptor names.
func patByte(o uint64) byte { return byte(o ^ o>>8 ^ o>>16 ^ 0x5a) }

// slotModel is what the harness wrote for one sequence number.
type slotModel struct {
	seq              uint64
	stampOK          bool // stamp == seq+1 when written
	valid            bool // passes every check the reader applies
	epoch, index     uint64
	flags, n         uint32
	metaLen          uint32
	meta             []byte
	used             uint64
	dtype, ndim      [ring.MaxTensors]int32
	shape, strides   [ring.MaxTensors][ring.MaxDims]int64
	offset, nbytes   [ring.MaxTensors]uint64
	payloadFileStart uint64
}

type fuzzSeg struct {
	t         *testing.T
	name      string
	f         *os.File
	seg       *ring.Segment
	g         ring.Geometry
	slots     uint64
	published uint64
	written   map[uint64]*slotModel // by seq
	bySlot    map[uint64]uint64     // slot index -> seq last written there
	corrupted map[uint64]bool       // seqs whose stamp was overwritten after writing
	closed    bool
	dead      bool
	claimHit  bool // the reader's claim word was overwritten
}

var fuzzN atomic.Int64

// outcomes counts what the harness saw, by kind; TestAttachHarnessReaches
// checks that random inputs reach every kind (the harness is not vacuous).
var outcomes = map[string]*atomic.Int64{}

func init() {
	for _, k := range []string{"attach-ok", "attach-fail", "batch", "tensor-bytes", "corrupt", "evicted",
		"closed", "gone", "estate", "released"} {
		outcomes[k] = new(atomic.Int64)
	}
}

func count(k string) { outcomes[k].Add(1) }

func dtypeSize(d int32) uint64 { return uint64(ring.DtypeSize(d)) }

// writeSlot writes a fuzzed slot for seq (not yet published).
func (fs *fuzzSeg) writeSlot(seq uint64, s *stream) {
	raw := fs.seg.SlotBytes(seq)
	clear(raw)
	m := &slotModel{seq: seq, stampOK: true}
	m.epoch, m.index = uint64(s.u8()%3), uint64(s.u8()%3)
	if s.u8()%4 == 0 {
		m.flags = ring.FlagEpochEnd
	}
	m.n = uint32(s.u8() % 4)
	if s.u8() == 0xfe {
		m.n = uint32(ring.MaxTensors) + 1
	}
	m.metaLen = uint32(s.u8() % 9)
	if s.u8() == 0xfd {
		m.metaLen = uint32(ring.MetaMax) + 1
	}
	spb := fs.g.SlotPayloadBytes
	switch s.u8() % 6 {
	case 0, 1, 2:
		m.used = spb
	case 3:
		m.used = uint64(s.u16()) % (spb + 1)
	case 4:
		m.used = spb + 1 + uint64(s.u8())
	default:
		m.used = 64
	}
	kind := uint32(0)
	if s.u8() == 0xfc {
		kind = 1
	}
	m.valid = m.n <= uint32(ring.MaxTensors) && m.metaLen <= uint32(ring.MetaMax) && m.used <= spb && kind == 0
	for i := 0; i < int(min(m.n, uint32(ring.MaxTensors))); i++ {
		dt := int32(s.u8() % 15)
		nd := int32(s.u8() % 4)
		switch s.u8() {
		case 0xfb:
			nd = int32(ring.MaxDims) + 1
		case 0xfa:
			nd = -1
		}
		item := max(dtypeSize(dt), 1)
		contiguous := s.u8()%2 == 0
		last, empty := uint64(0), false
		count := int64(1)
		for d := int(min(max(nd, 0), int32(ring.MaxDims))) - 1; d >= 0; d-- {
			ext := int64(s.u8() % 6)
			if s.u8() == 0xf9 {
				ext = -1
			}
			st := int64(s.u8() % 5)
			if contiguous {
				st = count
			}
			count *= max(ext, 1)
			m.shape[i][d], m.strides[i][d] = ext, st
			if ext == 0 {
				empty = true
			} else if ext > 0 && st >= 0 {
				last += uint64(ext-1) * uint64(st)
			}
		}
		off := uint64(s.u16() % 512)
		if s.u8()%4 != 0 {
			off = off / item * item
		}
		var nb uint64
		switch s.u8() % 4 {
		case 0, 3:
			if !empty {
				nb = (last + 1) * item
			}
		case 1:
			nb = (last+1)*item + uint64(s.u8()%3)
		default:
			nb = uint64(s.u16())
		}
		m.dtype[i], m.ndim[i], m.offset[i], m.nbytes[i] = dt, nd, off, nb
		d := raw[ring.SlotOffTensors+uintptr(i)*ring.ShmTensorSize:]
		binary.LittleEndian.PutUint32(d[ring.TensorOffDtype:], uint32(dt))
		binary.LittleEndian.PutUint32(d[ring.TensorOffNdim:], uint32(nd))
		binary.LittleEndian.PutUint64(d[ring.TensorOffOffset:], off)
		binary.LittleEndian.PutUint64(d[ring.TensorOffNbytes:], nb)
		for k := 0; k < ring.MaxDims; k++ {
			binary.LittleEndian.PutUint64(d[ring.TensorOffShape+uintptr(8*k):], uint64(m.shape[i][k]))
			binary.LittleEndian.PutUint64(d[ring.TensorOffStrides+uintptr(8*k):], uint64(m.strides[i][k]))
		}
		// The oracle: the same rule the producer applies (FuzzCheckTensor
		// checks that rule against an independent model).
		if ring.CheckTensor((*ring.ShmTensor)(unsafe.Pointer(&d[0])), m.used) != ring.StatusOK {
			m.valid = false
		}
	}
	m.meta = make([]byte, min(m.metaLen, uint32(ring.MetaMax)))
	for k := range m.meta {
		m.meta[k] = s.u8()
	}
	copy(raw[ring.SlotOffMeta:], m.meta)
	binary.LittleEndian.PutUint64(raw[ring.SlotOffEpoch:], m.epoch)
	binary.LittleEndian.PutUint64(raw[ring.SlotOffIndex:], m.index)
	binary.LittleEndian.PutUint32(raw[ring.SlotOffFlags:], m.flags)
	binary.LittleEndian.PutUint32(raw[ring.SlotOffNTensors:], m.n)
	binary.LittleEndian.PutUint64(raw[ring.SlotOffPayloadBytes:], m.used)
	binary.LittleEndian.PutUint32(raw[ring.SlotOffMetaLen:], m.metaLen)
	binary.LittleEndian.PutUint32(raw[ring.SlotOffPayloadKind:], kind)
	m.payloadFileStart = fs.g.PayloadOffset + fs.seg.SlotIndex(seq)*spb
	stamp := seq + 1
	if s.u8() == 0xf8 {
		stamp, m.stampOK = seq+2, false
	}
	atomic.StoreUint64((*uint64)(unsafe.Pointer(&raw[ring.SlotOffStamp])), stamp)
	fs.written[seq] = m
	fs.bySlot[fs.seg.SlotIndex(seq)] = seq
}

// stampOK: the slot of seq holds seq's stamp now.
func (fs *fuzzSeg) stampOK(seq uint64) bool {
	m := fs.written[seq]
	return m != nil && m.stampOK && !fs.corrupted[seq] && fs.bySlot[fs.seg.SlotIndex(seq)] == seq
}

func (fs *fuzzSeg) publish(k int, s *stream) {
	for ; k > 0; k-- {
		fs.writeSlot(fs.published, s)
		fs.published++
		fs.seg.StorePublished(fs.published)
	}
}

var (
	reBatch = regexp.MustCompile(`batch (\d+)`)
)

func batchOf(err error) (uint64, bool) {
	m := reBatch.FindStringSubmatch(err.Error())
	if m == nil {
		return 0, false
	}
	v, e := strconv.ParseUint(m[1], 10, 64)
	return v, e == nil
}

// FuzzAttachAcquire: see the file comment. geom packs the geometry and
// options; hdrPatch is (offset, byte) pairs patched into the header page
// after it was written; slotData feeds the slots; script the actions.
func FuzzAttachAcquire(f *testing.F) {
	f.Add(uint32(0), []byte{}, []byte{}, []byte{0, 2, 5, 0, 2, 2, 5})
	f.Add(uint32(1<<6|2), []byte{}, []byte{1, 2, 3, 4, 5}, []byte{0, 10, 2, 3, 5, 6, 2, 2})
	f.Add(uint32(1<<6|1<<7), []byte{}, []byte{0, 0, 0, 1, 0, 0, 0, 0, 5, 3, 1}, []byte{30, 2, 2, 2, 2, 8, 2, 5})
	f.Add(uint32(1<<5), []byte{}, []byte{}, []byte{2})                                     // no producer: gone at attach
	f.Add(uint32(1<<9), []byte{}, []byte{}, []byte{2})                                     // truncated
	f.Add(uint32(0), []byte{8, 0, 0}, []byte{}, []byte{2})                                 // being built
	f.Add(uint32(0), []byte{8, 0, 7}, []byte{}, []byte{2})                                 // other version
	f.Add(uint32(0), []byte{0, 0, 1}, []byte{}, []byte{2})                                 // bad magic
	f.Add(uint32(0), []byte{24, 0, 3}, []byte{}, []byte{2})                                // slot count not a power of two
	f.Add(uint32(3), []byte{0, 1, 0xff, 7, 1, 0xff}, []byte{}, []byte{2})                  // published huge (bytes 256, 263)
	f.Add(uint32(1<<6), []byte{}, []byte{}, []byte{0, 6, 2, 2, 2})                         // closed
	f.Add(uint32(1<<6), []byte{}, []byte{}, []byte{0, 7, 2, 2, 2})                         // producer dies
	f.Add(uint32(1<<6), []byte{}, []byte{}, []byte{0, 9, 2, 0, 2})                         // stamp overwritten
	f.Add(uint32(2|5<<11), []byte{152, 0, 2, 160, 0, 4}, []byte{0, 0}, []byte{0, 2, 2, 2}) // join window
	f.Fuzz(func(t *testing.T, geom uint32, hdrPatch, slotData, script []byte) {
		if len(hdrPatch) > 300 || len(script) > 200 {
			return
		}
		hung := time.AfterFunc(20*time.Second, func() {
			panic(fmt.Sprintf("FuzzAttachAcquire: iteration hung (geom %#x patch %x script %x)", geom, hdrPatch, script))
		})
		defer hung.Stop()
		runAttachCase(t, geom, hdrPatch, slotData, script)
	})
}

func runAttachCase(t *testing.T, geom uint32, hdrPatch, slotData, script []byte) {
	slots := uint32(2) << (geom & 3)
	capacity := 1 + (geom>>2)&3
	spb := uint64(4096) << ((geom >> 4) & 1)
	lockHeld := geom&(1<<5) == 0
	startNow := geom&(1<<6) != 0
	maxHeld := 1 + int((geom>>7)&3)
	sizeMode := (geom >> 9) & 3
	prePublish := int((geom >> 11) & 31)

	name := fmt.Sprintf("fuzz-%d-%d", os.Getpid(), fuzzN.Add(1))
	path := ring.ChannelPath(name)
	g, ok := ring.ComputeGeometry(slots, capacity, spb)
	if !ok {
		t.Fatalf("harness geometry %d %d %d", slots, capacity, spb)
	}
	fl, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(path)
	defer fl.Close()
	if err := fl.Truncate(int64(g.TotalBytes)); err != nil {
		t.Fatal(err)
	}
	seg, err := ring.MapSegment(fl, g, slots, capacity, true)
	if err != nil {
		t.Fatal(err)
	}
	defer seg.Unmap()
	fs := &fuzzSeg{t: t, name: name, f: fl, seg: seg, g: g, slots: uint64(slots),
		written: map[uint64]*slotModel{}, bySlot: map[uint64]uint64{}, corrupted: map[uint64]bool{}}
	for k := uint64(0); k < uint64(slots); k++ {
		p := seg.Payload(k)
		base := g.PayloadOffset + k*g.SlotPayloadBytes
		for j := range p {
			p[j] = patByte(base + uint64(j))
		}
	}
	table, err := readers.Listen(seg, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer table.Close()
	seg.InitHeader(name, os.Getpid(), 1)
	table.Serve()
	sd := &stream{b: slotData}
	fs.publish(prePublish, sd)
	if lockHeld {
		if err := ring.LockByte(fl, ring.LockProducer); err != nil {
			t.Fatal(err)
		}
	}
	hdr := unsafe.Slice((*byte)(unsafe.Pointer(seg.Header())), ring.HeaderSize)
	orig := append([]byte(nil), hdr[:72]...)
	for i := 0; i+2 < len(hdrPatch); i += 3 {
		off := int(binary.LittleEndian.Uint16(hdrPatch[i:])) % 512
		hdr[off] = hdrPatch[i+2]
	}
	fs.published = seg.Published()
	fs.closed = seg.State() == ring.StateClosed
	fileSize := g.TotalBytes
	switch sizeMode {
	case 1:
		fileSize -= 4096
	case 2:
		fileSize += 4096
	case 3:
		fileSize++
	}
	raw := sizeMode != 0 || string(orig) != string(hdr[:72]) // geometry changed: no content oracle
	hdrCopy := append([]byte(nil), hdr...)
	if fileSize != g.TotalBytes {
		table.Close() // it writes the roster
		seg.Unmap()   // never touch a mapping past a shrunk file
		if err := fl.Truncate(int64(fileSize)); err != nil {
			t.Fatal(err)
		}
	}
	want, _ := ring.CheckHeader(hdrCopy, fileSize)
	if fileSize != g.TotalBytes {
		hdr = nil
	}
	switch want {
	case ring.StatusOK:
		if !lockHeld {
			want = ring.StatusProducerGone
		}
	case ring.StatusAgain:
		want = ring.StatusTimedOut // attach does not wait (timeout 0)
	}

	o := reader.Options{MaxHeld: maxHeld, Spin: -1}
	if startNow {
		o.Start = reader.StartNow
	}
	r, err := reader.Attach(name, o)
	if got := ring.StatusOf(err); got != want {
		t.Fatalf("attach: status %d (%v), the header rule says %d", got, err, want)
	}
	if err != nil {
		if err.Error() == "" {
			t.Fatalf("attach failed (status %d) without a message", ring.StatusOf(err))
		}
		count("attach-fail")
		return
	}
	count("attach-ok")
	// Attached: the reader holds record 0 (the first free one).
	if locked, _ := seg.ReaderLocked(0); !locked && !raw {
		t.Fatalf("attached reader holds no lock on record 0")
	}

	var held []*reader.Batch
	lastSeq, haveLast := uint64(0), false
	acquire := func() {
		b, err := r.Acquire(0)
		st := ring.StatusOf(err)
		switch {
		case err == nil && b == nil:
			return
		case err == nil:
			if len(held) >= maxHeld {
				t.Fatalf("acquired batch %d while holding %d (max_held %d)", b.Seq, len(held), maxHeld)
			}
			if haveLast && b.Seq <= lastSeq {
				t.Fatalf("batch %d after batch %d", b.Seq, lastSeq)
			}
			lastSeq, haveLast = b.Seq, true
			// Every byte of every tensor lies in the mapping: read them.
			count("batch")
			for _, tn := range b.Tensors {
				if len(tn.Data) > 0 {
					count("tensor-bytes")
				}
				var sum byte
				for _, c := range tn.Data {
					sum ^= c
				}
				_ = sum
			}
			if !raw {
				fs.checkBatch(b)
			}
			held = append(held, b)
		case st == ring.StatusState:
			count("estate")
			if len(held) == 0 {
				t.Fatalf("ESTATE while holding nothing: %v", err)
			}
		case st == ring.StatusCorrupt:
			count("corrupt")
			if raw {
				return
			}
			n, ok := batchOf(err)
			m := fs.written[n]
			if !ok || m == nil || m.valid {
				t.Fatalf("ECORRUPT for a batch written valid (%v); model %+v", err, m)
			}
		case st == ring.StatusEvicted:
			count("evicted")
			if raw || fs.claimHit {
				return
			}
			n, ok := batchOf(err)
			if !ok || fs.stampOK(n) {
				t.Fatalf("EEVICTED for a batch whose stamp is intact: %v", err)
			}
		case st == ring.StatusClosed:
			count("closed")
			if !fs.closed && !raw {
				t.Fatalf("ECLOSED from an open channel: %v", err)
			}
		case st == ring.StatusProducerGone:
			count("gone")
			if !fs.dead && !raw {
				t.Fatalf("EPRODUCER_GONE while the producer lock is held: %v", err)
			}
		default:
			t.Fatalf("acquire returned undocumented status %d: %v", st, err)
		}
	}

	sc := &stream{b: script}
	for sc.i < len(sc.b) {
		op := sc.u8()
		if op%10 >= 6 && (op/10)%4 != 0 {
			op = 2 // the disruptive actions are rarer than reading
		}
		switch op % 10 {
		case 0, 1:
			if hdr != nil {
				fs.publish(1+int(op/10)%4, sd)
			}
		case 2, 3, 4:
			acquire()
		case 5:
			if len(held) == 0 {
				continue
			}
			k := int(sc.u8()) % len(held)
			err := r.Release(held[k])
			if st := ring.StatusOf(err); err != nil && st != ring.StatusEvicted {
				t.Fatalf("release: %v", err)
			}
			held = held[k+1:]
			count("released")
		case 6:
			if hdr != nil {
				seg.SetState(ring.StateClosed)
				fs.closed = true
			}
		case 7:
			if lockHeld {
				ring.UnlockByte(fl, ring.LockProducer)
				fs.dead = true
			}
		case 8:
			if hdr != nil {
				v := sc.u64()
				if sc.u8()%2 == 0 {
					v = ring.MakeClaim(v>>8, ring.ReaderEvicted)
				}
				seg.SetClaim(0, v)
				fs.claimHit = true
			}
		case 9:
			if hdr != nil && fs.published > 0 {
				seq := fs.published - 1 - uint64(sc.u8())%min(fs.published, fs.slots)
				atomic.StoreUint64((*uint64)(unsafe.Pointer(&seg.SlotBytes(seq)[ring.SlotOffStamp])), seq+1+fs.slots*uint64(1+sc.u8()%2))
				fs.corrupted[seq] = true
			}
		}
	}
	if err := r.Detach(); err != nil {
		t.Fatalf("detach: %v", err)
	}
	if hdr != nil {
		if locked, _ := seg.ReaderLocked(0); locked {
			t.Fatalf("detached reader still holds its record lock")
		}
		// The producer frees the entry when the connection ends.
		for deadline := time.Now().Add(10 * time.Second); !fs.claimHit; time.Sleep(time.Millisecond) {
			c := seg.Claim(0)
			if ring.ClaimState(c) == ring.ReaderFree {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("detached reader's entry still in state %d", ring.ClaimState(c))
			}
		}
	}
}

// checkBatch compares a handed-out batch with what was written.
func (fs *fuzzSeg) checkBatch(b *reader.Batch) {
	t := fs.t
	m := fs.written[b.Seq]
	if m == nil || !fs.stampOK(b.Seq) {
		t.Fatalf("batch %d handed out, but its slot does not hold it (model %+v)", b.Seq, m)
	}
	if !m.valid {
		t.Fatalf("batch %d handed out, but it breaks the rules: %+v", b.Seq, m)
	}
	if b.Epoch != m.epoch || b.Index != m.index || b.Flags != m.flags || len(b.Tensors) != int(m.n) ||
		string(b.Meta) != string(m.meta) {
		t.Fatalf("batch %d: got epoch %d index %d flags %d %d tensors meta %x; wrote %+v", b.Seq, b.Epoch,
			b.Index, b.Flags, len(b.Tensors), b.Meta, m)
	}
	for i, tn := range b.Tensors {
		nd := int(m.ndim[i])
		if tn.Dtype != m.dtype[i] || len(tn.Shape) != nd || len(tn.Strides) != nd {
			t.Fatalf("batch %d tensor %d: dtype %d shape %v, wrote dtype %d ndim %d", b.Seq, i, tn.Dtype, tn.Shape,
				m.dtype[i], nd)
		}
		for d := 0; d < nd; d++ {
			if tn.Shape[d] != m.shape[i][d] || tn.Strides[d] != m.strides[i][d] {
				t.Fatalf("batch %d tensor %d: shape %v strides %v, wrote %v %v", b.Seq, i, tn.Shape, tn.Strides,
					m.shape[i][:nd], m.strides[i][:nd])
			}
		}
		if uint64(len(tn.Data)) != m.nbytes[i] {
			t.Fatalf("batch %d tensor %d: %d data bytes, descriptor says %d", b.Seq, i, len(tn.Data), m.nbytes[i])
		}
		start := m.payloadFileStart + m.offset[i]
		for k, c := range tn.Data {
			if c != patByte(start+uint64(k)) {
				t.Fatalf("batch %d tensor %d: data byte %d is not the payload byte at offset %d", b.Seq, i, k, m.offset[i]+uint64(k))
			}
		}
	}
}

// TestAttachHarnessReaches runs the fuzz harness on random inputs and
// checks that they reach every outcome: batches handed out with data,
// corrupt and overwritten slots, closed, producer gone, max_held.
func TestAttachHarnessReaches(t *testing.T) {
	rnd := rand.New(rand.NewPCG(1, 2))
	bytes := func(n int) []byte {
		b := make([]byte, rnd.IntN(n))
		for i := range b {
			b[i] = byte(rnd.Uint32())
		}
		return b
	}
	before := map[string]int64{}
	for k, v := range outcomes {
		before[k] = v.Load()
	}
	for i := 0; i < 400; i++ {
		var patch []byte
		if rnd.IntN(4) == 0 {
			patch = bytes(12)
		}
		runAttachCase(t, rnd.Uint32()&^(3<<9|1<<5)|uint32(rnd.IntN(8)/7)<<9, patch, bytes(400), bytes(60))
		if t.Failed() {
			return
		}
	}
	for k, v := range outcomes {
		n := v.Load() - before[k]
		t.Logf("%-12s %d", k, n)
		if n == 0 {
			t.Errorf("no %s outcome in 400 random cases: the harness does not reach it", k)
		}
	}
}

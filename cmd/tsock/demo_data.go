package main

import (
	"encoding/binary"
	"fmt"
	"hash/crc32"
	"math"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

// The demo's batches: a float32 feature tensor [rows, cols] followed by an
// int64 label tensor [rows], both filled from a PRNG seeded by the batch's
// (epoch, index). The metadata carries the CRC-32C of each tensor's bytes,
// computed by the producer over what it wrote into shared memory; readers
// recompute them over what they see.

// demoCols is the feature width when the batch is large enough.
const demoCols = 64

// demoClasses is the number of label values.
const demoClasses = 1000

// castagnoli is the CRC-32C table (hardware-accelerated on amd64/arm64).
var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// demoLayout is where the two tensors of a demo batch lie in the payload.
type demoLayout struct {
	rows, cols int
	featBytes  uint64 // rows*cols*4, at offset 0
	labelOff   uint64 // 8-aligned
	labelBytes uint64 // rows*8
	total      uint64 // bytes reserved per batch
}

// newDemoLayout fits as many rows as possible into batchBytes.
func newDemoLayout(batchBytes uint64) (demoLayout, error) {
	if batchBytes < 16 {
		return demoLayout{}, fmt.Errorf("batch size %d bytes is too small (at least 16)", batchBytes)
	}
	// Widest rows first; rounding the label offset up to 8 bytes may cost
	// a row, or a column for tiny batches.
	for cols := min(uint64(demoCols), (batchBytes-8)/4); cols >= 1; cols-- {
		for rows := batchBytes / (cols*4 + 8); rows > 0; rows-- {
			l := demoLayout{rows: int(rows), cols: int(cols), featBytes: rows * cols * 4}
			l.labelOff = (l.featBytes + 7) &^ 7
			l.labelBytes = rows * 8
			l.total = l.labelOff + l.labelBytes
			if l.total <= batchBytes {
				return l, nil
			}
		}
	}
	return demoLayout{}, fmt.Errorf("batch size %d bytes holds no row", batchBytes)
}

// tensors describes the layout for Producer.Publish.
func (l demoLayout) tensors() []producer.Tensor {
	return []producer.Tensor{
		{Dtype: ring.DtypeFloat32, Shape: []int64{int64(l.rows), int64(l.cols)}},
		{Dtype: ring.DtypeInt64, Shape: []int64{int64(l.rows)}, Offset: l.labelOff},
	}
}

// String is a short description such as "float32[248,64] + int64[248]".
func (l demoLayout) String() string {
	return fmt.Sprintf("float32[%d,%d] + int64[%d]", l.rows, l.cols, l.rows)
}

// splitmix64 is a seed scrambler: distinct inputs give unrelated seeds.
func splitmix64(x uint64) uint64 {
	x += 0x9e3779b97f4a7c15
	x = (x ^ x>>30) * 0xbf58476d1ce4e5b9
	x = (x ^ x>>27) * 0x94d049bb133111eb
	return x ^ x>>31
}

// demoSeed is the PRNG seed of batch (epoch, index).
func demoSeed(epoch, index uint64) uint64 {
	s := splitmix64(epoch<<40 ^ index)
	if s == 0 {
		s = 1 // xorshift never leaves 0
	}
	return s
}

// xorshift64 is Marsaglia's xorshift; cheap enough to fill GB/s.
func xorshift64(x uint64) uint64 {
	x ^= x << 13
	x ^= x >> 7
	x ^= x << 17
	return x
}

// fill writes batch (epoch, index) into buf (len >= l.total) and returns
// its metadata.
func (l demoLayout) fill(buf []byte, epoch, index uint64) []byte {
	seed := demoSeed(epoch, index)
	x := seed
	feat := buf[:l.featBytes]
	const scale = 1.0 / (1 << 24)
	i := 0
	for ; i+8 <= len(feat); i += 8 {
		x = xorshift64(x)
		lo := float32(uint32(x)>>8) * scale
		hi := float32(uint32(x>>32)>>8) * scale
		binary.LittleEndian.PutUint64(feat[i:], uint64(math.Float32bits(lo))|uint64(math.Float32bits(hi))<<32)
	}
	if i < len(feat) {
		x = xorshift64(x)
		binary.LittleEndian.PutUint32(feat[i:], math.Float32bits(float32(uint32(x)>>8)*scale))
	}
	labels := buf[l.labelOff : l.labelOff+l.labelBytes]
	for j := 0; j+8 <= len(labels); j += 8 {
		x = xorshift64(x)
		binary.LittleEndian.PutUint64(labels[j:], x%demoClasses)
	}
	return demoMeta{
		epoch:    epoch,
		index:    index,
		seed:     seed,
		featCRC:  crc32.Checksum(feat, castagnoli),
		labelCRC: crc32.Checksum(labels, castagnoli),
	}.marshal()
}

// demoMeta is the metadata of a demo batch.
type demoMeta struct {
	epoch, index, seed uint64
	featCRC, labelCRC  uint32
}

// demoMetaMagic starts every demo batch's metadata ("TSDM").
const demoMetaMagic = 0x4d445354

// demoMetaLen is the encoded size of demoMeta.
const demoMetaLen = 4 + 4 + 8 + 8 + 8 + 4 + 4

// marshal encodes m little-endian behind a magic number and version 1.
func (m demoMeta) marshal() []byte {
	b := make([]byte, demoMetaLen)
	binary.LittleEndian.PutUint32(b[0:], demoMetaMagic)
	binary.LittleEndian.PutUint32(b[4:], 1)
	binary.LittleEndian.PutUint64(b[8:], m.epoch)
	binary.LittleEndian.PutUint64(b[16:], m.index)
	binary.LittleEndian.PutUint64(b[24:], m.seed)
	binary.LittleEndian.PutUint32(b[32:], m.featCRC)
	binary.LittleEndian.PutUint32(b[36:], m.labelCRC)
	return b
}

// parseDemoMeta decodes what marshal wrote.
func parseDemoMeta(b []byte) (demoMeta, error) {
	if len(b) != demoMetaLen {
		return demoMeta{}, fmt.Errorf("metadata is %d bytes, want %d", len(b), demoMetaLen)
	}
	if binary.LittleEndian.Uint32(b[0:]) != demoMetaMagic || binary.LittleEndian.Uint32(b[4:]) != 1 {
		return demoMeta{}, fmt.Errorf("metadata has a foreign magic or version")
	}
	return demoMeta{
		epoch:    binary.LittleEndian.Uint64(b[8:]),
		index:    binary.LittleEndian.Uint64(b[16:]),
		seed:     binary.LittleEndian.Uint64(b[24:]),
		featCRC:  binary.LittleEndian.Uint32(b[32:]),
		labelCRC: binary.LittleEndian.Uint32(b[36:]),
	}, nil
}

// Package batchgen generates and verifies tsock's test batch format, the
// format that tests/c/check_reader.c checks too, so that Go and C readers
// can be compared line for line.
//
// A data batch with stream counter i (0-based count of data batches over the
// whole run; epoch markers are not counted) has two tensors:
//
//	tensor 0: UINT8, shape [L], L = 1 + (i*7919) % 60000, at offset 0;
//	          byte j = uint8((i*31 + j*7) ^ (j >> 8))
//	tensor 1: INT64, shape [2], at offset (L+7)/8*8, values {i, L}
//	meta:     8 bytes, little-endian FNV-1a 64 of tensor 0's bytes
//
// A reader folds every data batch's meta hash into
// fold = (fold ^ hash) * FNVPrime, starting at FNVBasis, and prints
//
//	check_reader batches=<N> markers=<M> first=<i> last=<i> fold=<hex>
package batchgen

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"strconv"
	"strings"
	"sync"

	"github.com/tsock/tsock/ring"
)

// FNV-1a 64 parameters.
const (
	FNVBasis uint64 = 14695981039346656037
	FNVPrime uint64 = 1099511628211
)

// MaxLen is the largest tensor-0 length; MaxPayload the largest payload of
// a batch (enough for SlotBytes of 64 KiB).
const (
	MaxLen     = 60000
	MaxPayload = (MaxLen+7)/8*8 + 16
)

// Len is L, the length of tensor 0 of batch i.
func Len(i uint64) int { return 1 + int((i*7919)%MaxLen) }

// Offset1 is the byte offset of tensor 1 for a tensor 0 of length l.
func Offset1(l int) uint64 { return uint64(l+7) / 8 * 8 }

// PayloadBytes is the payload size of batch i.
func PayloadBytes(i uint64) uint64 { return Offset1(Len(i)) + 16 }

// Byte is byte j of tensor 0 of batch i.
func Byte(i uint64, j int) byte { return uint8((i*31 + uint64(j)*7) ^ (uint64(j) >> 8)) }

// The pattern of batch i depends on i only through i*31 mod 256, so the 256
// patterns are built once (lazily) and copied: filling and checking a batch
// is then a memmove and a memcmp, even under the race detector.
var (
	patOnce [256]sync.Once
	pats    [256][]byte
)

func pattern(i uint64) []byte {
	a := uint8(i * 31)
	patOnce[a].Do(func() {
		p := make([]byte, MaxLen)
		for j := range p {
			p[j] = uint8((uint64(a) + uint64(j)*7) ^ (uint64(j) >> 8))
		}
		pats[a] = p
	})
	return pats[a]
}

// Tensor0 is the expected content of tensor 0 of batch i (shared, read-only).
func Tensor0(i uint64) []byte { return pattern(i)[:Len(i)] }

// Hash is FNV-1a 64 of b.
func Hash(b []byte) uint64 {
	h := FNVBasis
	for _, c := range b {
		h ^= uint64(c)
		h *= FNVPrime
	}
	return h
}

// Fold folds one meta hash into a running fold.
func Fold(fold, hash uint64) uint64 { return (fold ^ hash) * FNVPrime }

// Write writes batch i into buf (at least PayloadBytes(i) long) and returns
// its tensors and metadata, ready for Producer.Publish.
func Write(buf []byte, i uint64) ([]ring.Tensor, []byte) {
	l := Len(i)
	off := Offset1(l)
	if uint64(len(buf)) < off+16 {
		panic(fmt.Sprintf("batchgen: buffer of %d bytes for batch %d (needs %d)", len(buf), i, off+16))
	}
	copy(buf[:l], pattern(i))
	for k := l; uint64(k) < off; k++ {
		buf[k] = 0
	}
	binary.LittleEndian.PutUint64(buf[off:], i)
	binary.LittleEndian.PutUint64(buf[off+8:], uint64(l))
	meta := make([]byte, 8)
	binary.LittleEndian.PutUint64(meta, Hash(buf[:l]))
	return []ring.Tensor{
		{Dtype: ring.DtypeUint8, Shape: []int64{int64(l)}, Offset: 0},
		{Dtype: ring.DtypeInt64, Shape: []int64{2}, Offset: off},
	}, meta
}

// Tensor is a received tensor. Its fields match reader.Tensor, so a
// reader.Tensor converts to it directly: batchgen.Tensor(t).
type Tensor struct {
	Dtype   int32
	Shape   []int64
	Strides []int64
	Data    []byte
}

// Check verifies a received data batch and returns its stream counter i and
// meta hash.
func Check(ts []Tensor, meta []byte) (i uint64, hash uint64, err error) {
	if len(ts) != 2 {
		return 0, 0, fmt.Errorf("batch has %d tensors, want 2", len(ts))
	}
	t0, t1 := ts[0], ts[1]
	if t1.Dtype != ring.DtypeInt64 || len(t1.Shape) != 1 || t1.Shape[0] != 2 ||
		len(t1.Strides) != 1 || t1.Strides[0] != 1 || len(t1.Data) != 16 {
		return 0, 0, fmt.Errorf("tensor 1: dtype %d shape %v strides %v, %d bytes; want INT64 [2]",
			t1.Dtype, t1.Shape, t1.Strides, len(t1.Data))
	}
	i = binary.LittleEndian.Uint64(t1.Data)
	l := binary.LittleEndian.Uint64(t1.Data[8:])
	if l != uint64(Len(i)) {
		return i, 0, fmt.Errorf("batch %d: tensor 1 says L=%d, want %d", i, l, Len(i))
	}
	if t0.Dtype != ring.DtypeUint8 || len(t0.Shape) != 1 || t0.Shape[0] != int64(l) ||
		len(t0.Strides) != 1 || t0.Strides[0] != 1 || uint64(len(t0.Data)) != l {
		return i, 0, fmt.Errorf("batch %d: tensor 0: dtype %d shape %v strides %v, %d bytes; want UINT8 [%d]",
			i, t0.Dtype, t0.Shape, t0.Strides, len(t0.Data), l)
	}
	if !bytes.Equal(t0.Data, Tensor0(i)) {
		j := 0
		for j < len(t0.Data) && t0.Data[j] == Byte(i, j) {
			j++
		}
		return i, 0, fmt.Errorf("batch %d: tensor 0 byte %d is %#x, want %#x", i, j, t0.Data[j], Byte(i, j))
	}
	hash = Hash(t0.Data)
	if len(meta) != 8 || binary.LittleEndian.Uint64(meta) != hash {
		return i, hash, fmt.Errorf("batch %d: meta %x, want FNV-1a %016x", i, meta, hash)
	}
	return i, hash, nil
}

// Checker follows a stream of batches as a check_reader does.
type Checker struct {
	Batches, Markers uint64
	First, Last      uint64
	Fold             uint64
	started          bool
}

// NewChecker returns a Checker with the fold at its basis.
func NewChecker() *Checker { return &Checker{Fold: FNVBasis} }

// Data checks a data batch: its content and that its counter follows the
// previous one by exactly 1.
func (c *Checker) Data(ts []Tensor, meta []byte) error {
	i, h, err := Check(ts, meta)
	if err != nil {
		return err
	}
	if c.started && i != c.Last+1 {
		return fmt.Errorf("batch %d follows batch %d", i, c.Last)
	}
	if !c.started {
		c.First, c.started = i, true
	}
	c.Last = i
	c.Batches++
	c.Fold = Fold(c.Fold, h)
	return nil
}

// Marker counts an epoch-end marker.
func (c *Checker) Marker() { c.Markers++ }

// Line is the summary line, in check_reader's format (first and last are
// -1 when no data batch was seen).
func (c *Checker) Line() string {
	if c.Batches == 0 {
		return fmt.Sprintf("check_reader batches=0 markers=%d first=-1 last=-1 fold=%016x", c.Markers, c.Fold)
	}
	return fmt.Sprintf("check_reader batches=%d markers=%d first=%d last=%d fold=%016x",
		c.Batches, c.Markers, c.First, c.Last, c.Fold)
}

// ExpectedFold is the fold of data batches first..first+n-1.
func ExpectedFold(first, n uint64) uint64 {
	f := FNVBasis
	for i := first; i < first+n; i++ {
		f = Fold(f, Hash(Tensor0(i)))
	}
	return f
}

// None is First and Last of a Result without data batches ("-1").
const None = ^uint64(0)

// Result is a parsed summary line; Status is the TSOCK_ status name of the
// "check_reader status=..." line printed when the stream ended, if any.
type Result struct {
	Batches, Markers, First, Last, Fold uint64
	Status                              string
}

// ParseLine finds the last summary line in out and parses it. The fold may
// be written with or without 0x; first and last may be -1 (None).
func ParseLine(out string) (Result, error) {
	var r Result
	lines := strings.Split(out, "\n")
	for _, l := range lines {
		if st, ok := strings.CutPrefix(strings.TrimSpace(l), "check_reader status="); ok {
			r.Status = st
		}
	}
	for k := len(lines) - 1; k >= 0; k-- {
		s := strings.TrimSpace(lines[k])
		p := strings.Index(s, "check_reader batches=")
		if p < 0 {
			continue
		}
		seen := 0
		for _, f := range strings.Fields(s[p+len("check_reader "):]) {
			kv := strings.SplitN(f, "=", 2)
			if len(kv) != 2 {
				continue
			}
			base, v := 10, kv[1]
			if kv[0] == "fold" {
				base, v = 16, strings.TrimPrefix(strings.TrimPrefix(v, "0x"), "0X")
			}
			n, err := strconv.ParseUint(v, base, 64)
			if v == "-1" && (kv[0] == "first" || kv[0] == "last") {
				n, err = None, nil
			}
			if err != nil {
				return r, fmt.Errorf("summary line %q: %s: %w", s, kv[0], err)
			}
			switch kv[0] {
			case "batches":
				r.Batches = n
			case "markers":
				r.Markers = n
			case "first":
				r.First = n
			case "last":
				r.Last = n
			case "fold":
				r.Fold = n
			default:
				continue
			}
			seen++
		}
		if seen != 5 {
			return r, fmt.Errorf("summary line %q lacks fields", s)
		}
		return r, nil
	}
	return r, fmt.Errorf("no check_reader summary line in output %q", out)
}

package batchgen

import (
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"hash/fnv"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/ring"
)

// received turns what Write produced into what a reader would see.
func received(t *testing.T, buf []byte, ts []ring.Tensor) []Tensor {
	t.Helper()
	out := make([]Tensor, len(ts))
	for k, x := range ts {
		n := uint64(ring.DtypeSize(x.Dtype))
		for _, e := range x.Shape {
			n *= uint64(e)
		}
		out[k] = Tensor{Dtype: x.Dtype, Shape: x.Shape, Strides: []int64{1}, Data: buf[x.Offset : x.Offset+n]}
	}
	return out
}

func TestSpec(t *testing.T) {
	assert.Equal(t, 1, Len(0))
	assert.Equal(t, 1+7919, Len(1))
	assert.Equal(t, 1+(12345*7919)%60000, Len(12345))
	assert.LessOrEqual(t, PayloadBytes(7), uint64(MaxPayload))
	assert.Equal(t, uint64(8), Offset1(1))
	assert.Equal(t, uint64(8), Offset1(8))
	assert.Equal(t, uint64(16), Offset1(9))
	for _, i := range []uint64{0, 1, 5, 255, 256, 9999, 1 << 40} {
		p := Tensor0(i)
		require.Len(t, p, Len(i))
		for j := range p {
			if want := uint8((i*31 + uint64(j)*7) ^ (uint64(j) >> 8)); p[j] != want {
				t.Fatalf("batch %d byte %d: %#x, want %#x", i, j, p[j], want)
			}
		}
	}
	h := fnv.New64a()
	h.Write(Tensor0(3))
	assert.Equal(t, h.Sum64(), Hash(Tensor0(3)))
	assert.Equal(t, FNVBasis, Hash(nil))
	basis, prime := FNVBasis, FNVPrime
	assert.Equal(t, (basis^5)*prime, Fold(FNVBasis, 5))
}

func TestWriteCheck(t *testing.T) {
	buf := make([]byte, MaxPayload)
	c := NewChecker()
	for i := uint64(100); i < 130; i++ {
		for k := range buf {
			buf[k] = 0xee
		}
		ts, meta := Write(buf, i)
		require.Len(t, ts, 2)
		assert.Equal(t, Offset1(Len(i)), ts[1].Offset)
		require.NoError(t, c.Data(received(t, buf, ts), meta))
	}
	assert.Equal(t, uint64(30), c.Batches)
	assert.Equal(t, uint64(100), c.First)
	assert.Equal(t, uint64(129), c.Last)
	assert.Equal(t, ExpectedFold(100, 30), c.Fold)
	c.Marker()
	r, err := ParseLine("noise\n" + c.Line() + "\n")
	require.NoError(t, err)
	assert.Equal(t, Result{Batches: 30, Markers: 1, First: 100, Last: 129, Fold: c.Fold}, r)
}

func TestCheckDetects(t *testing.T) {
	buf := make([]byte, MaxPayload)
	mk := func(i uint64) ([]Tensor, []byte) {
		ts, meta := Write(buf, i)
		return received(t, buf, ts), meta
	}

	ts, meta := mk(7)
	ts[0].Data[100] ^= 1
	_, _, err := Check(ts, meta)
	assert.ErrorContains(t, err, "byte 100")

	ts, meta = mk(7)
	meta[0] ^= 1
	_, _, err = Check(ts, meta)
	assert.ErrorContains(t, err, "meta")

	ts, meta = mk(7)
	binary.LittleEndian.PutUint64(ts[1].Data[8:], 3)
	_, _, err = Check(ts, meta)
	assert.ErrorContains(t, err, "L=3")

	ts, meta = mk(7)
	_, _, err = Check(ts[:1], meta)
	assert.Error(t, err)

	ts, meta = mk(7)
	ts[0].Dtype = ring.DtypeInt8
	_, _, err = Check(ts, meta)
	assert.ErrorContains(t, err, "tensor 0")

	c := NewChecker()
	ts, meta = mk(7)
	require.NoError(t, c.Data(ts, meta))
	ts, meta = mk(9)
	assert.ErrorContains(t, c.Data(ts, meta), "batch 9 follows batch 7")
	ts, meta = mk(7)
	assert.Error(t, c.Data(ts, meta), "a repeated batch")
}

func TestParseLine(t *testing.T) {
	r, err := ParseLine("check_reader batches=3 markers=1 first=0 last=2 fold=0xdeadbeef")
	require.NoError(t, err)
	assert.Equal(t, Result{Batches: 3, Markers: 1, First: 0, Last: 2, Fold: 0xdeadbeef}, r)
	r, err = ParseLine("check_reader status=TSOCK_ECLOSED\n" + NewChecker().Line() + "\n")
	require.NoError(t, err)
	assert.Equal(t, Result{Markers: 0, First: None, Last: None, Fold: FNVBasis, Status: "TSOCK_ECLOSED"}, r)
	_, err = ParseLine("nothing here")
	assert.Error(t, err)
	_, err = ParseLine("check_reader batches=3 markers=1")
	assert.Error(t, err)
	_, err = ParseLine("check_reader batches=x markers=1 first=0 last=2 fold=1")
	assert.Error(t, err)
}

// TestCWriterMatchesGo: batchgen_write (batchgen.h), with which the C soak
// producer publishes, writes byte for byte the payload, tensors and
// metadata that Write does (testdata/cwrite.c prints them).
func TestCWriterMatchesGo(t *testing.T) {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler: %v", err)
	}
	exe := filepath.Join(t.TempDir(), "cwrite")
	out, err := exec.Command(cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I../../include",
		"testdata/cwrite.c", "-o", exe).CombinedOutput()
	require.NoError(t, err, "%s", out)
	is := []uint64{0, 1, 2, 7, 8, 255, 256, 7577, 9999, 1 << 40, 1<<40 + 12345, 3<<40 + 59999}
	args := make([]string, len(is))
	for k, i := range is {
		args[k] = strconv.FormatUint(i, 10)
	}
	out, err = exec.Command(exe, args...).Output()
	require.NoError(t, err)
	lines := strings.Split(strings.TrimSpace(string(out)), "\n")
	require.Len(t, lines, len(is))
	buf := make([]byte, MaxPayload)
	for k, i := range is {
		for j := range buf {
			buf[j] = 0xee
		}
		ts, meta := Write(buf, i)
		want := fmt.Sprintf("i=%d", i)
		for n, x := range ts {
			nbytes := uint64(ring.DtypeSize(x.Dtype)) * uint64(x.Shape[0])
			want += fmt.Sprintf(" t%d=%d,1,%d,1,%d,%d", n, x.Dtype, x.Shape[0], x.Offset, nbytes)
		}
		want += " meta=" + hex.EncodeToString(meta) + " payload=" + hex.EncodeToString(buf[:PayloadBytes(i)])
		if lines[k] != want {
			n := 0
			for n < len(want) && n < len(lines[k]) && want[n] == lines[k][n] {
				n++
			}
			t.Fatalf("batch %d: C and Go differ from character %d:\nC:  %.200s\nGo: %.200s", i, n, lines[k][n:], want[n:])
		}
	}
}

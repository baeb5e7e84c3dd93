package ring_test

import (
	"fmt"
	"go/token"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"runtime"
	"strconv"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/ring"
)

// repoRoot is the repository root (this file lives in ring/).
func repoRoot(t *testing.T) string {
	t.Helper()
	_, file, _, ok := runtime.Caller(0)
	require.True(t, ok)
	return filepath.Dir(filepath.Dir(file))
}

type layoutStruct struct {
	cname string
	typ   reflect.Type
}

var layoutStructs = []layoutStruct{
	{"tsock_header", reflect.TypeOf(ring.Header{})},
	{"tsock_roster_entry", reflect.TypeOf(ring.RosterEntry{})},
	{"tsock_reader_record", reflect.TypeOf(ring.ReaderRecord{})},
	{"tsock_join_request", reflect.TypeOf(ring.JoinRequest{})},
	{"tsock_join_reply", reflect.TypeOf(ring.JoinReply{})},
	{"tsock_slot", reflect.TypeOf(ring.Slot{})},
	{"tsock_shm_tensor", reflect.TypeOf(ring.ShmTensor{})},
}

// cFieldName undoes cgo's renaming of C fields that are Go keywords
// ("type" becomes "_type").
func cFieldName(goName string) string {
	if rest, ok := strings.CutPrefix(goName, "_"); ok && token.IsKeyword(rest) {
		return rest
	}
	return goName
}

type goField struct {
	cname  string
	offset uintptr
	size   uintptr
}

func goFields(typ reflect.Type) []goField {
	var out []goField
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		if f.Name == "_" { // padding cgo inserted
			continue
		}
		out = append(out, goField{cname: cFieldName(f.Name), offset: f.Offset, size: f.Type.Size()})
	}
	return out
}

// cLayout compiles and runs a C program that prints, for every struct and
// field, "struct.field offset size" and "struct sizeof".
func cLayout(t *testing.T) map[string][2]uint64 {
	t.Helper()
	if _, err := exec.LookPath("cc"); err != nil {
		t.Skip("no C compiler (cc) on PATH")
	}
	var src strings.Builder
	src.WriteString("#include <stddef.h>\n#include <stdio.h>\n#include \"layout.h\"\n" +
		"#define F(s, f) printf(\"%s.%s %zu %zu\\n\", #s, #f, offsetof(s, f), sizeof(((s *)0)->f))\n" +
		"int main(void) {\n")
	for _, s := range layoutStructs {
		fmt.Fprintf(&src, "  printf(\"%s %%zu %%zu\\n\", sizeof(%s), _Alignof(%s));\n", s.cname, s.cname, s.cname)
		for _, f := range goFields(s.typ) {
			fmt.Fprintf(&src, "  F(%s, %s);\n", s.cname, f.cname)
		}
	}
	src.WriteString("  return 0;\n}\n")
	dir := t.TempDir()
	cfile, exe := filepath.Join(dir, "layout.c"), filepath.Join(dir, "layout")
	require.NoError(t, os.WriteFile(cfile, []byte(src.String()), 0o644))
	root := repoRoot(t)
	out, err := exec.Command("cc", "-std=c11", "-Wall", "-Werror", "-I"+filepath.Join(root, "include"),
		"-I"+filepath.Join(root, "ring"), cfile, "-o", exe).CombinedOutput()
	require.NoError(t, err, "compiling the layout probe:\n%s\n%s", out, src.String())
	out, err = exec.Command(exe).CombinedOutput()
	require.NoError(t, err, "%s", out)
	res := map[string][2]uint64{}
	for _, line := range strings.Split(strings.TrimSpace(string(out)), "\n") {
		f := strings.Fields(line)
		require.Len(t, f, 3, "probe line %q", line)
		a, err1 := strconv.ParseUint(f[1], 10, 64)
		b, err2 := strconv.ParseUint(f[2], 10, 64)
		require.NoError(t, err1)
		require.NoError(t, err2)
		res[f[0]] = [2]uint64{a, b}
	}
	return res
}

// TestLayoutMatchesC checks that every field cgo shows Go lies where the C
// compiler puts it, with the same size, and that the structs agree in size
// and alignment.
func TestLayoutMatchesC(t *testing.T) {
	c := cLayout(t)
	for _, s := range layoutStructs {
		fields := goFields(s.typ)
		require.NotEmpty(t, fields, s.cname)
		sz, ok := c[s.cname]
		require.True(t, ok, "no C size for %s", s.cname)
		assert.Equal(t, sz[0], uint64(s.typ.Size()), "sizeof(%s)", s.cname)
		assert.Equal(t, sz[1], uint64(s.typ.Align()), "_Alignof(%s)", s.cname)
		var covered uintptr
		for _, f := range fields {
			key := s.cname + "." + f.cname
			cf, ok := c[key]
			if !assert.True(t, ok, "C has no field %s", key) {
				continue
			}
			assert.Equal(t, cf[0], uint64(f.offset), "offsetof(%s)", key)
			assert.Equal(t, cf[1], uint64(f.size), "sizeof(%s)", key)
			covered += f.size
		}
		// Every byte of the struct is a named field: layout.h pads
		// explicitly, so cgo must have inserted no padding of its own.
		assert.Equal(t, s.typ.Size(), covered, "%s has implicit padding", s.cname)
	}
}

func TestLayoutPinned(t *testing.T) {
	off := func(typ reflect.Type, name string) uintptr {
		f, ok := typ.FieldByName(name)
		require.True(t, ok, "%s has no field %s", typ, name)
		return f.Offset
	}
	h := reflect.TypeOf(ring.Header{})
	assert.Equal(t, uintptr(4096), h.Size())
	assert.Equal(t, uintptr(0), off(h, "magic"))
	assert.Equal(t, uintptr(8), off(h, "layout_version"))
	assert.Equal(t, uintptr(64), off(h, "total_bytes"))
	assert.Equal(t, uintptr(128), off(h, "state"))
	assert.Equal(t, uintptr(256), off(h, "published"))
	assert.Equal(t, uintptr(384), off(h, "stat_backpressure_ns"))
	// published alone on its two lines; stats on their own lines.
	assert.Equal(t, uintptr(256+128), off(h, "stat_backpressure_ns"))
	assert.Less(t, off(h, "epoch"), uintptr(256-8+1))
	assert.Equal(t, uintptr(512), off(h, "gpu_pool"))
	assert.Equal(t, uintptr(576), off(h, "gpu_mem_handle"))
	assert.Equal(t, uintptr(640), off(h, "join_key"))

	re := reflect.TypeOf(ring.RosterEntry{})
	assert.Equal(t, uintptr(128), re.Size())
	assert.Equal(t, uintptr(0), off(re, "claim"))
	assert.Equal(t, uintptr(64), off(re, "wait_ns"))

	// The record's cursor line, placement line and sleeping flag (on its
	// own pair of lines) in one page.
	rr := reflect.TypeOf(ring.ReaderRecord{})
	assert.Equal(t, uintptr(256), rr.Size())
	assert.Equal(t, uintptr(0), off(rr, "cursor"))
	assert.Equal(t, uintptr(64), off(rr, "placement"))
	assert.Equal(t, uintptr(128), off(rr, "sleeping"))
	assert.LessOrEqual(t, rr.Size(), uintptr(ring.RecordFileBytes))

	assert.Equal(t, uintptr(24), reflect.TypeOf(ring.JoinRequest{}).Size())
	assert.Equal(t, uintptr(40), reflect.TypeOf(ring.JoinReply{}).Size())

	st := reflect.TypeOf(ring.ShmTensor{})
	assert.Equal(t, uintptr(152), st.Size())
	sl := reflect.TypeOf(ring.Slot{})
	assert.Equal(t, uintptr(0), off(sl, "stamp"))
	assert.Equal(t, uintptr(64), off(sl, "tensors"))
	assert.Equal(t, uintptr(64+ring.MaxTensors*152), off(sl, "meta"))
	assert.Equal(t, uintptr(64+ring.MaxTensors*152+ring.MetaMax), off(sl, "cuda_event"))
	assert.Equal(t, uintptr(64+ring.MaxTensors*152+ring.MetaMax+64), sl.Size())
	assert.Zero(t, sl.Size()%64)

	assert.Equal(t, ring.HeaderSize, h.Size())
	assert.Equal(t, ring.RosterEntrySize, re.Size())
	assert.Equal(t, ring.ReaderRecordSize, rr.Size())
	assert.Equal(t, ring.SlotSize, sl.Size())
	assert.Equal(t, ring.ShmTensorSize, st.Size())

	// The magic spells "TSOCKSHM" in a little-endian word.
	var b [8]byte
	for i := range b {
		b[i] = byte(ring.Magic >> (8 * i))
	}
	assert.Equal(t, "TSOCKSHM", string(b[:]))
	for i := range b {
		b[i] = byte(ring.JoinMagic >> (8 * i))
	}
	assert.Equal(t, "SOCKJOIN", string(b[:]))
}

// TestJoinAddress: the join socket's abstract address is a NUL, a fixed
// prefix and the key in hex, the same in C (layout.h) and Go; messages
// encode to their structs' sizes and decode back.
func TestJoinAddress(t *testing.T) {
	var key [16]byte
	for i := range key {
		key[i] = byte(0xf0 + i)
	}
	assert.Equal(t, "\x00tsock-join-f0f1f2f3f4f5f6f7f8f9fafbfcfdfeff", ring.JoinAddress(key))
	req := ring.NewJoinRequest(1)
	b := req.Bytes()
	assert.Len(t, b, int(ring.JoinRequestSize))
	got, ok := ring.ParseJoinRequest(b)
	assert.True(t, ok)
	assert.Equal(t, req, got)
	_, ok = ring.ParseJoinRequest(b[1:])
	assert.False(t, ok, "a short request")
	rep := ring.JoinReplyMsg{Magic: ring.JoinMagic, LayoutVersion: 4, Status: -11, Claim: 5<<8 | 1, Start: 77,
		Index: 3, Flags: 1}
	r2, ok := ring.ParseJoinReply(rep.Bytes())
	assert.True(t, ok)
	assert.Equal(t, rep, r2)
}

func TestGeometry(t *testing.T) {
	cases := []struct {
		slots, readers uint32
		bytes          uint64
	}{
		{2, 1, 1}, {16, 64, 1 << 20}, {4, 3, 4097}, {65536, 1024, 4096}, {1024, 1000, 12345},
		{2, 1, ring.MaxSlotBytes},
	}
	for _, c := range cases {
		g, ok := ring.ComputeGeometry(c.slots, c.readers, c.bytes)
		require.True(t, ok, "%+v", c)
		page := ring.PageSize
		assert.Equal(t, page, g.RosterOffset, "%+v", c)
		for _, v := range []uint64{g.RosterOffset, g.SlotsOffset, g.PayloadOffset, g.TotalBytes, g.SlotPayloadBytes} {
			assert.Zero(t, v%page, "%+v: %+v not page aligned", c, g)
		}
		assert.GreaterOrEqual(t, g.SlotPayloadBytes, c.bytes)
		assert.Less(t, g.SlotPayloadBytes-c.bytes, page)
		readersEnd := g.RosterOffset + uint64(c.readers)*uint64(ring.RosterEntrySize)
		assert.GreaterOrEqual(t, g.SlotsOffset, readersEnd)
		assert.Less(t, g.SlotsOffset-readersEnd, page)
		slotsEnd := g.SlotsOffset + uint64(c.slots)*uint64(ring.SlotSize)
		assert.GreaterOrEqual(t, g.PayloadOffset, slotsEnd)
		assert.Less(t, g.PayloadOffset-slotsEnd, page)
		assert.Equal(t, g.PayloadOffset+uint64(c.slots)*g.SlotPayloadBytes, g.TotalBytes)
	}

	// Exact values for the defaults: 64 readers need 64*128 bytes of
	// roster (2 pages from 4096), 16 slots 16*2752 bytes (11 pages).
	g, ok := ring.ComputeGeometry(16, 64, 1<<20)
	require.True(t, ok)
	assert.Equal(t, ring.Geometry{RosterOffset: 4096, SlotsOffset: 4096 + 2*4096,
		PayloadOffset: 4096 + 2*4096 + 11*4096, TotalBytes: 4096 + 2*4096 + 11*4096 + 16<<20,
		SlotPayloadBytes: 1 << 20}, g)

	bad := []struct {
		slots, readers uint32
		bytes          uint64
	}{
		{0, 1, 4096}, {1, 1, 4096}, {3, 1, 4096}, {6, 1, 4096}, {65537, 1, 4096}, {131072, 1, 4096},
		{1 << 31, 1, 4096}, {4, 0, 4096}, {4, 1025, 4096}, {4, 1, 0}, {4, 1, ring.MaxSlotBytes + 1},
		{4, 1, ^uint64(0)},
	}
	for _, c := range bad {
		_, ok := ring.ComputeGeometry(c.slots, c.readers, c.bytes)
		assert.False(t, ok, "%+v accepted", c)
	}
}

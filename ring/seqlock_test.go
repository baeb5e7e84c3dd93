package ring_test

import (
	"go/build"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/ring"
)

// TestBeginSlotOrdering pins the seqlock writer's barrier (BeginSlot: the
// stamp 0 must be visible before any later store). What it guards
// against is a reordering that x86, where this runs, never performs, and
// no arm64 machine or cross C compiler is at hand: no test here can
// observe it. So this test pins the mechanism:
//   - BeginSlot zeroes the stamp;
//   - every Linux architecture Go supports gets exactly one beginSlot
//     (order_*.go), and only the store-ordered ones (amd64, 386, s390x)
//     the bare atomic store: arm64 the DMB ISHST, the others the C11
//     release fence (before the fix: a bare atomic store everywhere, so no
//     file matched);
//   - barrier.StoreStore assembles, for arm64, to DMB ISHST (0xd5033ebf).
func TestBeginSlotOrdering(t *testing.T) {
	g, ok := ring.ComputeGeometry(4, 1, 4096)
	require.True(t, ok)
	f, err := os.Create(filepath.Join(t.TempDir(), "seg"))
	require.NoError(t, err)
	defer f.Close()
	require.NoError(t, f.Truncate(int64(g.TotalBytes)))
	seg, err := ring.MapSegment(f, g, 4, 1, true)
	require.NoError(t, err)
	defer seg.Unmap()
	seg.WriteSlot(5, &ring.SlotContents{}, nil)
	require.Equal(t, uint64(6), seg.SlotStamp(5))
	seg.BeginSlot(9) // same slot as 5
	assert.Zero(t, seg.SlotStamp(5))

	_, self, _, _ := runtime.Caller(0)
	dir := filepath.Dir(self)
	impls := map[string]string{"order_tso.go": "tso", "order_arm64.go": "dmb ishst", "order_cgo.go": "c11 release fence"}
	tso := map[string]bool{"amd64": true, "386": true, "s390x": true}
	for _, arch := range []string{"386", "amd64", "arm", "arm64", "loong64", "mips", "mips64", "mips64le",
		"mipsle", "ppc64", "ppc64le", "riscv64", "s390x"} {
		ctx := build.Default
		ctx.GOOS, ctx.GOARCH, ctx.CgoEnabled = "linux", arch, true
		var got []string
		for file, how := range impls {
			ok, err := ctx.MatchFile(dir, file)
			require.NoError(t, err, file)
			if ok {
				got = append(got, how)
			}
		}
		require.Len(t, got, 1, "GOARCH=%s: beginSlot implementations %v", arch, got)
		want := "c11 release fence"
		switch {
		case tso[arch]:
			want = "tso"
		case arch == "arm64":
			want = "dmb ishst"
		}
		assert.Equal(t, want, got[0], "GOARCH=%s", arch)
	}

	gobin, err := exec.LookPath("go")
	if err != nil {
		gobin = filepath.Join(runtime.GOROOT(), "bin", "go")
	}
	obj := filepath.Join(t.TempDir(), "barrier_arm64.o")
	asm := exec.Command(gobin, "tool", "asm", "-p", "github.com/tsock/tsock/ring/internal/barrier",
		"-I", filepath.Join(runtime.GOROOT(), "pkg", "include"), "-o", obj, filepath.Join(dir, "internal", "barrier", "barrier_arm64.s"))
	asm.Env = append(os.Environ(), "GOARCH=arm64")
	out, err := asm.CombinedOutput()
	require.NoError(t, err, "go tool asm: %s", out)
	out, err = exec.Command(gobin, "tool", "objdump", obj).CombinedOutput()
	require.NoError(t, err, "go tool objdump: %s", out)
	assert.Contains(t, string(out), "d5033ebf", "barrier.StoreStore must be DMB ISHST:\n%s", out)
}

// BenchmarkBeginSlot: the cost of opening a slot, once per published batch.
func BenchmarkBeginSlot(b *testing.B) {
	g, _ := ring.ComputeGeometry(4, 1, 4096)
	f, err := os.Create(filepath.Join(b.TempDir(), "seg"))
	require.NoError(b, err)
	defer f.Close()
	require.NoError(b, f.Truncate(int64(g.TotalBytes)))
	seg, err := ring.MapSegment(f, g, 4, 1, true)
	require.NoError(b, err)
	defer seg.Unmap()
	for i := 0; b.Loop(); i++ {
		seg.BeginSlot(uint64(i))
	}
}

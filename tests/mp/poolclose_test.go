package mp

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

// TestHelperPoolClose is a child process (the CUDA driver is loaded once
// per process, here the fake one): a producer with a device pool, and a
// rogue reader in it that claims the device path and bumps its cursor
// every millisecond, as a reader draining would. It prints how long Close
// took.
func TestHelperPoolClose(t *testing.T) {
	if os.Getenv(envRole) != "poolclose" {
		t.Skip("helper process")
	}
	name := strings.Fields(os.Getenv(envArgs))[0]
	p, err := producer.Create(name, producer.Options{Slots: 4, SlotBytes: 4096, MaxReaders: 4, Device: "cuda:0"})
	if err != nil {
		fmt.Println("create:", err)
		os.Exit(1)
	}
	r, err := testkit.JoinRogue(name, 0)
	if err != nil {
		fmt.Println("join:", err)
		os.Exit(1)
	}
	r.Set(ring.RecordOffPlacement, uint64(ring.PlacementDevice)) // with cuda_ordinal 0 in the high half
	go func() {
		for c := uint64(1); ; c++ {
			r.Set(ring.RecordOffCursor, c)
			time.Sleep(time.Millisecond)
		}
	}()
	start := time.Now()
	err = p.Close()
	fmt.Printf("close took %.1f s (%v)\n", time.Since(start).Seconds(), err)
	os.Exit(0)
}

// TestPoolCloseBoundedAgainstFakeProgress (review 1, item 5): a reader
// that fakes progress on the device path (its own record: cursor always
// moving) no longer holds the producer's Close for ever: its cursor counts
// only up to what was published, and the whole wait is capped. Before the
// fix Close never returned while the rogue wrote.
func TestPoolCloseBoundedAgainstFakeProgress(t *testing.T) {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	if _, err := exec.LookPath(cc); err != nil {
		t.Skipf("no C compiler for the fake CUDA driver: %v", err)
	}
	lib := filepath.Join(t.TempDir(), "libfakecuda.so")
	out, err := exec.Command(cc, "-shared", "-fPIC", "-O2", "-std=gnu11",
		filepath.Join(repoRoot, "tests", "c", "fake_cuda.c"), "-lpthread", "-o", lib).CombinedOutput()
	require.NoError(t, err, "building the fake CUDA driver: %s", out)
	exe, err := os.Executable()
	require.NoError(t, err)
	name := channel(t)
	var pid int
	t.Cleanup(func() {
		// The pool was left to the driver: the fake one keeps its memory
		// in /dev/shm files named after the process.
		for _, kind := range []string{"mem", "ev"} {
			files, _ := filepath.Glob(fmt.Sprintf("/dev/shm/tsockfake.%s.%d.*", kind, pid))
			for _, f := range files {
				os.Remove(f)
			}
		}
	})
	p := start(t, "pool close", []string{envRole + "=poolclose", envArgs + "=" + name, "TSOCK_LIBCUDA=" + lib},
		exe, "-test.run=^TestHelperPoolClose$")
	pid = p.cmd.Process.Pid
	// poolDrainTimeout (5 s) after the last counted progress, 30 s at
	// most; the bound leaves a loaded machine room.
	line := p.waitLine(t, "close took", 90*time.Second)
	t.Log(line)
	var took float64
	_, err = fmt.Sscanf(line, "close took %f s", &took)
	require.NoError(t, err)
	assert.Less(t, took, 40.0, "Close waited on a reader's fake progress")
	assert.Equal(t, 0, p.wait(t, 30*time.Second))
}

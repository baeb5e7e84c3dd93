package main

import (
	"strings"
	"testing"
)

// TestReadCostSurvivesPreemption runs the reading-cost child with a 1 ms
// stall before each payload check, as a preemption on a loaded machine
// would cause. A child that checks a batch after releasing it reads the
// batch the producer published into the reused slot and exits 1 (CI's
// random "8 MiB | FAILED: child N: exit status 1"); checking while the
// batch is held cannot fail however long the stall.
func TestReadCostSurvivesPreemption(t *testing.T) {
	exe, _, err := buildHelper(repoRoot(), t.TempDir())
	if err != nil {
		if strings.Contains(err.Error(), "executable file not found") {
			t.Skipf("no C compiler: %v", err)
		}
		t.Fatal(err)
	}
	t.Setenv("TBENCH_STALL_NS", "1000000")
	for _, size := range []uint64{4096, 1 << 20} {
		row := readCost(config{quick: true, helper: exe}, size)
		if row.Err != "" {
			t.Fatalf("%d-byte batches: %s", size, row.Err)
		}
		if row.Samples == 0 {
			t.Fatalf("%d-byte batches: no sample timed", size)
		}
	}
}

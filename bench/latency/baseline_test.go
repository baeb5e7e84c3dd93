package main

import "testing"

// TestTakeSamplesOutOfTime: round trips so slow (a loaded machine) that
// the deadline passes during the warm-up still give minSamples samples, not
// none (the cache-line baseline was NaN and bench/run.py failed on its
// JSON); on time, the warm-up is dropped and n samples are kept.
func TestTakeSamplesOutOfTime(t *testing.T) {
	clock := uint64(0)
	slow := func(i uint64) (uint64, uint64, bool) {
		clock += 10_000_000 // 10 ms per round trip
		return clock - 10_000_000, clock, true
	}
	got := takeSamples(400, 200, 50_000_000, slow)
	if len(got) != minSamples {
		t.Fatalf("%d samples past the deadline, want %d", len(got), minSamples)
	}
	if got[0] != 5_000_000 {
		t.Fatalf("sample %d ns, want half the round trip", got[0])
	}

	clock = 0
	calls := 0
	fast := func(i uint64) (uint64, uint64, bool) {
		calls++
		clock += 100
		return clock - 100, clock, true
	}
	got = takeSamples(400, 200, 1<<62, fast)
	if len(got) != 400 || calls != 600 {
		t.Fatalf("%d samples in %d round trips, want 400 in 600", len(got), calls)
	}
}

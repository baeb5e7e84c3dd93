package main

import (
	"os"
	"testing"
	"time"
)

// The helper processes of the benchmark are this binary re-executed (see
// startChild): in a test binary, TestMain runs them instead of the tests.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == childArg {
		os.Exit(childMain(os.Args[2:]))
	}
	os.Exit(m.Run())
}

// TestPingPongSamplesAfterLongWarmup: the cache-line baseline takes samples
// however long its warmup took. With a time cap shorter than the warmup (as
// on a loaded machine, where every round trip waits for a time slice) it
// took none before the fix: a NaN median, which failed the benchmark's JSON
// ("json: unsupported value: NaN", CI's failed quick benchmark under load).
func TestPingPongSamplesAfterLongWarmup(t *testing.T) {
	shm, err := newSharedPage()
	if err != nil {
		t.Fatal(err)
	}
	defer shm.remove()
	cfg := config{samples: 100, warmup: 50, maxTime: time.Nanosecond}
	st, err := pingPong(cfg, shm)
	if err != nil {
		t.Fatal(err)
	}
	if st.n == 0 || st.median != st.median {
		t.Fatalf("no sample after the warmup: %+v", st)
	}
	t.Logf("%d samples, median %.3f µs", st.n, st.median)
}

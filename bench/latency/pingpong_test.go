package main

import (
	"math"
	"os"
	"testing"
)

// TestMain lets this test binary be the ping-pong child, as the latency
// binary is for itself (startChild runs os.Executable()).
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == childArg {
		os.Exit(childMain(os.Args[2:]))
	}
	os.Exit(m.Run())
}

// TestPingPongPastDeadlineStillSamples: on a loaded machine the warm-up
// round trips can outlast the time budget; the baseline must still time
// some round trips rather than report NaN (which also broke the JSON
// output of bench/run.py: "json: unsupported value: NaN"). A zero budget
// is the extreme of that.
func TestPingPongPastDeadlineStillSamples(t *testing.T) {
	shm, err := newSharedPage()
	if err != nil {
		t.Fatal(err)
	}
	defer shm.remove()
	st, err := pingPong(config{samples: 10, warmup: 100, maxTime: 0}, shm)
	if err != nil {
		t.Fatal(err)
	}
	if st.n == 0 || math.IsNaN(st.median) {
		t.Fatalf("no round trip timed: %+v", st)
	}
}

package main

import (
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
)

// snapWith is a snapshot at `at` of one reader that reports waitNs.
func snapWith(at time.Time, waitNs uint64) statSnap {
	r := readerInfo{Index: 3, Pid: 42, State: "active", Alive: true, WaitNs: waitNs, startTime: 7}
	s := statSnap{at: at, readers: map[readerKey]readerInfo{{3, 42, 7}: r}}
	s.info.ReaderList = []readerInfo{r}
	return s
}

// TestWatchReaders: the average stall is the wait a reader reports since
// stat first saw it over the time since then, clamped to 0..1; a wait
// time that goes back (reader-written, untrusted) starts the count afresh.
func TestWatchReaders(t *testing.T) {
	t0 := time.Unix(1000, 0)
	w := map[readerKey]watched{}
	first := statSample{Readers: readerLines(snapWith(t0, 5e9))}
	watchReaders(w, snapWith(t0, 5e9), &first)
	assert.Equal(t, 0.0, first.Readers[0].StallAvg, "nothing watched yet")

	s := statSample{Readers: readerLines(snapWith(t0.Add(4*time.Second), 6e9))}
	watchReaders(w, snapWith(t0.Add(4*time.Second), 6e9), &s)
	assert.InDelta(t, 0.25, s.Readers[0].StallAvg, 1e-9, "1 s of wait in 4 s")
	assert.InDelta(t, 4.0, s.Readers[0].WatchedS, 1e-9)

	s = statSample{Readers: readerLines(snapWith(t0.Add(5*time.Second), 60e9))}
	watchReaders(w, snapWith(t0.Add(5*time.Second), 60e9), &s)
	assert.Equal(t, 1.0, s.Readers[0].StallAvg, "a reader claiming more wait than time is clamped")

	s = statSample{Readers: readerLines(snapWith(t0.Add(6*time.Second), 1e9))}
	watchReaders(w, snapWith(t0.Add(6*time.Second), 1e9), &s)
	assert.Equal(t, 0.0, s.Readers[0].WatchedS, "a wait time that went back is counted afresh")

	watchReaders(w, statSnap{at: t0.Add(7 * time.Second)}, &statSample{})
	assert.Empty(t, w, "a reader gone is forgotten")
}

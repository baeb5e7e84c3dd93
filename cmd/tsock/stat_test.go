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

// TestWatchReadersSinceAttach: with the producer's attach time in the
// roster, the average stall is the reader's whole wait over the time since
// it attached, from the first sample on; an attach time stat's clock has
// not reached (a foreign or broken segment) falls back to watching.
func TestWatchReadersSinceAttach(t *testing.T) {
	t0 := time.Unix(1000, 0)
	snap := func(mono, attachNs, waitNs uint64) statSnap {
		s := snapWith(t0, waitNs)
		s.mono = mono
		r := s.info.ReaderList[0]
		r.attachNs = attachNs
		s.info.ReaderList[0] = r
		s.readers[readerKey{3, 42, 7}] = r
		return s
	}
	w := map[readerKey]watched{}
	b := snap(50e9, 40e9, 2.5e9)
	s := statSample{Readers: readerLines(b)}
	watchReaders(w, b, &s)
	r := s.Readers[0]
	assert.True(t, r.SinceAttach)
	assert.InDelta(t, 10.0, r.WatchedS, 1e-9, "attached 10 s ago")
	assert.InDelta(t, 0.25, r.StallAvg, 1e-9, "2.5 s of wait in 10 s")
	assert.Empty(t, w, "nothing to watch: the roster says when")

	b = snap(50e9, 40e9, 30e9)
	s = statSample{Readers: readerLines(b)}
	watchReaders(w, b, &s)
	assert.Equal(t, 1.0, s.Readers[0].StallAvg, "more wait than time is clamped")

	b = snap(50e9, 60e9, 1e9)
	s = statSample{Readers: readerLines(b)}
	watchReaders(w, b, &s)
	assert.False(t, s.Readers[0].SinceAttach, "an attach time in the future is not believed")
	assert.Equal(t, 0.0, s.Readers[0].WatchedS)
	assert.Len(t, w, 1, "watched from now on instead")
}

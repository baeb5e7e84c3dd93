package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/tsock/tsock/ring"
)

func init() {
	register(&command{
		name:    "stat",
		args:    "NAME",
		summary: "live statistics of a channel: publish rate, per-reader lag and data stall",
		help: `Samples channel NAME every --interval and prints, for the interval:
the producer's publish rate and the share of time it was back-pressured
(waiting for the slowest reader), and for each reader its lag (batches
published but not yet released), its read rate and its data stall: the
share of the interval it spent waiting for data, and that share averaged
over the time since the reader attached (AVG STALL, over OVER seconds; the
producer writes the attach time in the roster; for a segment of a producer
from before that field, since stat first saw the reader). The stall comes from the wait time each reader accounts
in its record when a wait ends, a value the reader writes (untrusted,
clamped to 0-100%); a reader that is caught up and saw nothing published
during the whole interval is shown as stalled 100% (it is still waiting).

A producer fed by a tsock.Pipeline also writes its figures once a second
(/dev/shm/.tsock-stats.NAME): stat then prints a pipeline line with its
worker processes (and read threads), the seconds each stage took per
second of the interval (workers summed), and its decoded-sample cache's hit
rate over the interval and bytes held.

Only reads the segment (read-only mapping, no lock, no reader record).
If the producer is replaced by a new one, stat follows the new segment.

With --json, each sample is one JSON object on its own line.
Exit status: 0; 1 if the channel does not exist or disappears.`,
		run:   runStat,
		flags: func() *flag.FlagSet { var o statOptions; return o.flagSet(io.Discard) },
	})
}

type statOptions struct {
	interval time.Duration
	count    int
	jsonOut  bool
}

func (o *statOptions) flagSet(w io.Writer) *flag.FlagSet {
	fs := newFlagSet("stat", w)
	fs.DurationVar(&o.interval, "interval", time.Second, "sampling interval")
	fs.IntVar(&o.count, "count", 0, "samples to print, then exit (0: until interrupted)")
	fs.BoolVar(&o.jsonOut, "json", false, "print one JSON object per sample")
	return fs
}

// statReader is one reader's line of a sample.
type statReader struct {
	readerInfo
	BatchRate float64 `json:"batch_rate"` // batches acquired per second
	Stall     float64 `json:"stall"`      // share of the interval spent waiting for data, 0..1
	New       bool    `json:"new"`        // joined during the interval (rates cover part of it)
	// StallAvg is the share of the WatchedS seconds since the reader
	// attached (SinceAttach) or, where the roster has no attach time, since
	// this stat first saw it, that it spent waiting for data, 0..1.
	StallAvg    float64 `json:"stall_avg"`
	WatchedS    float64 `json:"watched_s"`
	SinceAttach bool    `json:"since_attach"`
}

// watched is a reader as stat first saw it: when, and its wait time then.
type watched struct {
	at     time.Time
	waitNs uint64
}

// watchReaders fills in each sample reader's average stall: since its
// attach time where the roster has one, else since w first saw it. It adds
// the readers of snapshot b not seen before to w (and those whose
// reader-written wait time went back: counted afresh) and drops those gone.
func watchReaders(w map[readerKey]watched, b statSnap, s *statSample) {
	for k := range w {
		if _, ok := b.readers[k]; !ok {
			delete(w, k)
		}
	}
	for i := range s.Readers {
		r := &s.Readers[i]
		if r.attachNs != 0 && r.attachNs < b.mono {
			// The wait time a reader accounts starts at 0 in the record
			// the producer made for it at this attach.
			r.WatchedS, r.SinceAttach = float64(b.mono-r.attachNs)/1e9, true
			r.StallAvg = clamp01(float64(r.WaitNs) / 1e9 / r.WatchedS)
			continue
		}
		k := readerKey{r.Index, r.Pid, r.startTime}
		first, ok := w[k]
		if !ok || first.waitNs > r.WaitNs {
			first = watched{at: b.at, waitNs: r.WaitNs}
			w[k] = first
		}
		r.WatchedS = b.at.Sub(first.at).Seconds()
		if r.WatchedS > 0 {
			r.StallAvg = clamp01(float64(r.WaitNs-first.waitNs) / 1e9 / r.WatchedS)
		}
	}
}

// statSample is one interval of `tsock stat`.
type statSample struct {
	Time         string       `json:"time"`
	Channel      string       `json:"channel"`
	State        string       `json:"state"`
	ProducerPid  int32        `json:"producer_pid"`
	Slots        uint32       `json:"slots"`
	IntervalSec  float64      `json:"interval_s"`
	Published    uint64       `json:"published"`
	Epoch        uint64       `json:"epoch"`
	PublishRate  float64      `json:"publish_rate"` // batches per second
	Backpressure float64      `json:"backpressure"` // share of the interval the producer waited for readers, 0..1
	Reclaimed    uint64       `json:"readers_reclaimed"`
	Evicted      uint64       `json:"readers_evicted"`
	Readers      []statReader `json:"readers"`
	// The producer's tsock.Pipeline, when it writes its figures (nil: not
	// a Pipeline, or not yet).
	Pipeline *pipelineSample `json:"pipeline,omitempty"`
}

// statSnap is one read of the segment.
type statSnap struct {
	at        time.Time
	mono      uint64 // ring.MonotonicNs() at `at`: the clock of the roster's attach_ns
	published uint64
	backNs    uint64
	readers   map[readerKey]readerInfo
	info      channelInfo
	stats     ring.HeaderStats
	pipe      *pipelineNote
}

// readerKey identifies a reader across samples: the same record with
// another owner is another reader.
type readerKey struct {
	index     uint32
	pid       int32
	startTime uint64
}

func takeSnap(name string, seg *ring.Segment) statSnap {
	ci := channelInfo{Name: name, Path: ring.ChannelPath(name)}
	fillChannelInfo(&ci, seg)
	s := statSnap{at: time.Now(), mono: ring.MonotonicNs(), published: ci.Published, info: ci, stats: seg.Stats(),
		readers: map[readerKey]readerInfo{}}
	s.backNs = s.stats.BackpressureNs
	if st, ok := mustStat(seg.File).Sys().(*syscall.Stat_t); ok {
		s.pipe = readPipelineNote(name, st.Uid, int(ci.ProducerPid))
	}
	for _, r := range ci.ReaderList {
		s.readers[readerKey{r.Index, r.Pid, r.startTime}] = r
	}
	return s
}

// sampleBetween computes the rates of an interval.
func sampleBetween(a, b statSnap) statSample {
	dt := b.at.Sub(a.at).Seconds()
	if dt <= 0 {
		dt = 1e-9
	}
	s := statSample{Time: b.at.UTC().Format(time.RFC3339Nano), Channel: b.info.Name, State: b.info.State,
		ProducerPid: b.info.ProducerPid, Slots: b.info.Slots, IntervalSec: dt, Published: b.published,
		Epoch: b.info.Epoch, Reclaimed: b.stats.ReadersReclaimed, Evicted: b.stats.ReadersEvicted,
		Readers: []statReader{}}
	if b.published >= a.published {
		s.PublishRate = float64(b.published-a.published) / dt
	}
	if b.backNs >= a.backNs {
		s.Backpressure = clamp01(float64(b.backNs-a.backNs) / 1e9 / dt)
	}
	s.Pipeline = pipelineBetween(a.pipe, b.pipe, dt)
	for _, r := range b.info.ReaderList {
		if r.State == "free" {
			continue
		}
		sr := statReader{readerInfo: r}
		prev, seen := a.readers[readerKey{r.Index, r.Pid, r.startTime}]
		if !seen || prev.Batches > r.Batches || prev.WaitNs > r.WaitNs {
			sr.New = true
			prev = readerInfo{}
		}
		sr.BatchRate = float64(r.Batches-prev.Batches) / dt
		sr.Stall = clamp01(float64(r.WaitNs-prev.WaitNs) / 1e9 / dt)
		// A wait is accounted when it ends: a reader caught up during a whole
		// interval without anything published is waiting right now.
		if seen && !sr.New && r.Alive && r.Batches == prev.Batches && b.published == a.published &&
			r.Acquired >= b.published {
			sr.Stall = 1
		}
		s.Readers = append(s.Readers, sr)
	}
	return s
}

// readerLines is the sample lines of a snapshot's readers, without rates.
func readerLines(b statSnap) []statReader {
	var out []statReader
	for _, r := range b.info.ReaderList {
		if r.State != "free" {
			out = append(out, statReader{readerInfo: r})
		}
	}
	return out
}

func clamp01(v float64) float64 {
	switch {
	case v < 0:
		return 0
	case v > 1:
		return 1
	}
	return v
}

func runStat(e *env, args []string) int {
	o := statOptions{}
	fs := o.flagSet(e.stderr)
	pos, st, ok := parseInterspersed(fs, args)
	if !ok {
		return st
	}
	if len(pos) != 1 {
		fmt.Fprintf(e.stderr, "usage: tsock stat [--interval D] [--count N] [--json] NAME\n")
		return exitUsage
	}
	if o.interval <= 0 || o.count < 0 {
		fmt.Fprintf(e.stderr, "tsock stat: --interval must be positive and --count not negative\n")
		return exitUsage
	}
	name := pos[0]
	if !ring.NameOK(name) {
		fmt.Fprintf(e.stderr, "tsock stat: channel name %q is not 1..%d of [A-Za-z0-9._-]\n", name, ring.NameMax)
		return exitUsage
	}
	seg, err := openForStat(name)
	if err != nil {
		fmt.Fprintf(e.stderr, "tsock stat: %v\n", err)
		return exitFail
	}
	defer func() { seg.Close() }()

	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)

	if !o.jsonOut {
		fmt.Fprintln(e.stdout, "STALL*: share of the interval a reader waited for data; AVG STALL*: of the time OVER since")
		fmt.Fprintln(e.stdout, "it attached (~: since stat first saw it, the segment has no attach time). * from the wait")
		fmt.Fprintln(e.stdout, "time each reader reports (untrusted, clamped to 0-100%).")
	}
	prev := takeSnap(name, seg)
	watch := map[readerKey]watched{}
	watchReaders(watch, prev, &statSample{Readers: readerLines(prev)})
	tick := time.NewTicker(o.interval)
	defer tick.Stop()
	for n := 0; o.count == 0 || n < o.count; n++ {
		select {
		case <-tick.C:
		case <-sigs:
			return exitOK
		}
		// A producer that died and was replaced, or closed: follow the name.
		if !seg.StillNamed(ring.ChannelPath(name)) {
			next, err := openForStat(name)
			if err != nil {
				fmt.Fprintf(e.stderr, "tsock stat: channel %q is gone: %v\n", name, err)
				return exitFail
			}
			seg.Close()
			seg = next
			cur := takeSnap(name, seg)
			if !o.jsonOut {
				fmt.Fprintf(e.stdout, "channel %s: new segment, producer pid %d\n", name, cur.info.ProducerPid)
			}
			prev = cur
			watch = map[readerKey]watched{}
			watchReaders(watch, prev, &statSample{Readers: readerLines(prev)})
			n--
			continue
		}
		cur := takeSnap(name, seg)
		s := sampleBetween(prev, cur)
		watchReaders(watch, cur, &s)
		prev = cur
		if o.jsonOut {
			b, _ := json.Marshal(s)
			fmt.Fprintf(e.stdout, "%s\n", b)
		} else {
			printStat(e.stdout, s)
		}
	}
	return exitOK
}

func openForStat(name string) (*ring.Segment, error) {
	seg, err := ring.OpenSegment(name)
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("no channel %q (%s)", name, ring.ChannelPath(name))
	}
	return seg, err
}

func printStat(w io.Writer, s statSample) {
	fmt.Fprintf(w, "%s  channel %s  producer %d (%s)  published %d  epoch %d  %.0f batches/s  back-pressure %.1f%%\n",
		time.Now().Format("15:04:05"), s.Channel, s.ProducerPid, s.State, s.Published, s.Epoch, s.PublishRate,
		100*s.Backpressure)
	printPipeline(w, s.Pipeline)
	if len(s.Readers) == 0 {
		fmt.Fprintf(w, "  no readers\n")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "  READER\tPID\tSTATE\tLAG\tBATCHES\tBATCHES/s\tSTALL*\tAVG STALL*\tOVER")
	for _, r := range s.Readers {
		state := r.State
		if !r.Alive {
			state += " (dead)"
		}
		over := "~"
		if r.SinceAttach {
			over = ""
		}
		fmt.Fprintf(tw, "  %d\t%d\t%s\t%d\t%d\t%.0f\t%.1f%%\t%.1f%%\t%s%.0fs\n", r.Index, r.Pid, state, r.Lag, r.Batches,
			r.BatchRate, 100*r.Stall, 100*r.StallAvg, over, r.WatchedS)
	}
	_ = tw.Flush()
}

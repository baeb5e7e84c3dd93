// Command latency measures tsock's one-way latency from publish to acquire
// between processes, and two raw baselines on the same machine:
//
//   - cache-line handoff: two processes ping-pong a counter over a shared
//     mapping, busy-polling; one-way = round trip / 2;
//   - futex wake-up: one process sleeps in FUTEX_WAIT on a shared word, the
//     other stamps CLOCK_MONOTONIC and calls FUTEX_WAKE; one-way = time until
//     the sleeper runs.
//
// For tsock the producer runs in this process and R reader processes (this
// binary re-executed) compute now - batch.PublishNs for every batch; both
// clocks are CLOCK_MONOTONIC. The producer publishes one small batch per
// --interval so that readers are always waiting when a batch arrives, in
// two modes: "spin" (readers busy-poll, Spin = 1 s) and "futex" (readers
// never spin and always sleep on the futex).
//
// Usage:
//
//	go run ./bench/latency [--readers 1,4] [--modes spin,futex] [--samples N] [--quick]
package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"
	_ "unsafe" // go:linkname

	"github.com/tsock/tsock/ring"
	"golang.org/x/sys/unix"
)

// childArg as os.Args[1] makes this binary one of the helper processes.
const childArg = "__latency_child"

// config is the command line.
type config struct {
	readers  []int
	modes    []string
	samples  int           // samples per reader per configuration
	warmup   int           // leading samples dropped
	interval time.Duration // publish pacing
	payload  uint64        // bytes per batch
	maxTime  time.Duration // cap of one measurement
	paceSpin bool          // the publisher busy-waits between batches
	quick    bool
}

func main() {
	if len(os.Args) > 1 && os.Args[1] == childArg {
		os.Exit(childMain(os.Args[2:]))
	}
	cfg, err := parseConfig(os.Args[1:])
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintf(os.Stderr, "latency: %v\n", err)
		os.Exit(2)
	}
	if err := benchMain(cfg); err != nil {
		fmt.Fprintf(os.Stderr, "latency: %v\n", err)
		os.Exit(1)
	}
}

// parseConfig reads the flags; --quick lowers the defaults of the flags
// not given explicitly.
func parseConfig(args []string) (config, error) {
	fs := flag.NewFlagSet("latency", flag.ContinueOnError)
	readers := fs.String("readers", "1,4", "comma-separated reader counts")
	modes := fs.String("modes", "spin,futex", "comma-separated reader modes: spin (busy-poll), futex (always sleep)")
	samples := fs.Int("samples", 20000, "samples per reader per configuration (--quick: 2000)")
	warmup := fs.Int("warmup", 200, "leading samples dropped per reader")
	interval := fs.Duration("interval", 100*time.Microsecond, "time between two published batches")
	payload := fs.Uint64("payload", 64, "payload bytes per batch")
	maxTime := fs.Duration("max-time", 8*time.Second, "cap of one measurement (--quick: 1.5s)")
	paceSpin := fs.Bool("pace-spin", false, "publisher busy-waits between batches instead of sleeping (costs a CPU)")
	quick := fs.Bool("quick", false, "CI smoke run: fewer samples, under 10 s in all")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() != 0 {
		return config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	cfg := config{samples: *samples, warmup: *warmup, interval: *interval, payload: *payload,
		maxTime: *maxTime, paceSpin: *paceSpin, quick: *quick}
	if cfg.quick {
		if !set["samples"] {
			cfg.samples = 2000
		}
		if !set["max-time"] {
			cfg.maxTime = 1500 * time.Millisecond
		}
	}
	for _, s := range strings.Split(*readers, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 || n > 256 {
			return config{}, fmt.Errorf("--readers: %q is not a count in 1..256", s)
		}
		cfg.readers = append(cfg.readers, n)
	}
	for _, m := range strings.Split(*modes, ",") {
		m = strings.TrimSpace(m)
		if m != "spin" && m != "futex" {
			return config{}, fmt.Errorf("--modes: unknown mode %q (spin, futex)", m)
		}
		cfg.modes = append(cfg.modes, m)
	}
	if cfg.samples < 1 || cfg.warmup < 0 || cfg.interval <= 0 || cfg.payload < 8 || cfg.maxTime <= 0 {
		return config{}, fmt.Errorf("--samples, --interval, --max-time must be positive, --payload at least 8")
	}
	return cfg, nil
}

// childMain dispatches a helper process by role.
func childMain(args []string) int {
	if len(args) == 0 {
		fmt.Fprintf(os.Stderr, "latency child: no role\n")
		return 2
	}
	var err error
	switch args[0] {
	case "pingpong":
		err = pingPongChild(args[1:])
	case "futex":
		err = futexChild(args[1:])
	case "reader":
		err = tsockReaderChild(args[1:])
	default:
		err = fmt.Errorf("unknown role %q", args[0])
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "latency child %s (pid %d): %v\n", args[0], os.Getpid(), err)
		return 1
	}
	return 0
}

// nanotime is the Go runtime's CLOCK_MONOTONIC read through the vDSO
// (ring.MonotonicNs makes a clock_gettime system call, which costs more
// than what is measured here). checkClock verifies it is the same clock.
//
//go:linkname nanotime runtime.nanotime
func nanotime() int64

// now is the clock every measurement uses; CLOCK_MONOTONIC in ns.
func now() uint64 { return uint64(nanotime()) }

// checkClock makes sure nanotime and ring.MonotonicNs (the clock of
// PublishNs) agree, and returns the cost of one call of each.
func checkClock() (vdsoNs, syscallNs float64, err error) {
	for i := 0; i < 3; i++ {
		a := ring.MonotonicNs()
		b := now()
		c := ring.MonotonicNs()
		if a <= b && b <= c {
			const n = 20000
			t0 := now()
			for j := 0; j < n; j++ {
				_ = now()
			}
			t1 := now()
			for j := 0; j < n; j++ {
				_ = ring.MonotonicNs()
			}
			t2 := now()
			return float64(t1-t0) / n, float64(t2-t1) / n, nil
		}
	}
	return 0, 0, errors.New("runtime.nanotime is not CLOCK_MONOTONIC here; cannot compare with PublishNs")
}

// stats summarises one-way latencies in ns.
type stats struct {
	n                  int
	median, p99, p999  float64 // µs
	min, max           float64 // µs
	missed, lateWakeup int     // configuration-specific counters
}

// summarize sorts samples (ns) in place and computes the percentiles.
func summarize(samples []uint64) stats {
	if len(samples) == 0 {
		return stats{median: math.NaN(), p99: math.NaN(), p999: math.NaN(), min: math.NaN(), max: math.NaN()}
	}
	sort.Slice(samples, func(i, j int) bool { return samples[i] < samples[j] })
	q := func(p float64) float64 {
		return float64(samples[int(p*float64(len(samples)-1)+0.5)]) / 1e3
	}
	return stats{n: len(samples), median: q(0.5), p99: q(0.99), p999: q(0.999),
		min: float64(samples[0]) / 1e3, max: float64(samples[len(samples)-1]) / 1e3}
}

// machine describes the host: CPUs, model, kernel, Go.
func machine() string {
	model := "unknown CPU"
	if f, err := os.Open("/proc/cpuinfo"); err == nil {
		sc := bufio.NewScanner(f)
		for sc.Scan() {
			if k, v, ok := strings.Cut(sc.Text(), ":"); ok && strings.TrimSpace(k) == "model name" {
				model = strings.TrimSpace(v)
				break
			}
		}
		f.Close()
	}
	var u unix.Utsname
	kernel := "?"
	if unix.Uname(&u) == nil {
		kernel = unix.ByteSliceToString(u.Release[:])
	}
	load := "?"
	if b, err := os.ReadFile("/proc/loadavg"); err == nil {
		if f := strings.Fields(string(b)); len(f) >= 3 {
			load = strings.Join(f[:3], " ")
		}
	}
	return fmt.Sprintf("%d CPUs (nproc), %s, Linux %s, %s, load average %s",
		runtime.NumCPU(), model, kernel, runtime.Version(), load)
}

// tsockRow is one tsock configuration's result.
type tsockRow struct {
	mode     string
	readers  int
	st       stats
	interval time.Duration // achieved mean publish interval
	err      error
}

func benchMain(cfg config) error {
	start := time.Now()
	vdsoNs, syscallNs, err := checkClock()
	if err != nil {
		return err
	}
	fmt.Printf("machine: %s\n", machine())
	fmt.Printf("clock:   CLOCK_MONOTONIC; %.0f ns per vDSO read, %.0f ns per clock_gettime syscall (ring.MonotonicNs)\n",
		vdsoNs, syscallNs)
	pacing := "sleeping"
	if cfg.paceSpin {
		pacing = "busy-waiting"
	}
	fmt.Printf("run:     %d samples per reader (+%d warm-up), one %d-byte batch every %v (publisher %s in between), at most %v per measurement\n\n",
		cfg.samples, cfg.warmup, cfg.payload, cfg.interval, pacing, cfg.maxTime)

	shm, err := newSharedPage()
	if err != nil {
		return err
	}
	defer shm.remove()
	cache, err := pingPong(cfg, shm)
	if err != nil {
		return fmt.Errorf("cache-line baseline: %w", err)
	}
	shm.reset()
	fut, err := futexBaseline(cfg, shm)
	if err != nil {
		return fmt.Errorf("futex baseline: %w", err)
	}

	var rows []tsockRow
	for _, mode := range cfg.modes {
		for _, r := range cfg.readers {
			st, iv, err := tsockLatency(cfg, mode, r)
			rows = append(rows, tsockRow{mode: mode, readers: r, st: st, interval: iv, err: err})
		}
	}

	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "baseline (one-way)\tsamples\tmedian µs\tp99 µs\tp99.9 µs\tmax µs\t")
	fmt.Fprintf(tw, "cache-line handoff (RTT/2)\t%d\t%.3f\t%.3f\t%.3f\t%.1f\t\n", cache.n, cache.median, cache.p99, cache.p999, cache.max)
	fmt.Fprintf(tw, "futex wake -> waiter runs\t%d\t%.2f\t%.2f\t%.2f\t%.1f\t\n", fut.n, fut.median, fut.p99, fut.p999, fut.max)
	tw.Flush()
	if fut.lateWakeup > 0 {
		fmt.Printf("(futex baseline: %d wake-ups found the waiter not yet asleep; not counted)\n", fut.lateWakeup)
	}
	fmt.Println()

	tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "tsock publish -> acquire\treaders\tsamples\tmedian µs\tp99 µs\tp99.9 µs\tmax µs\tmedian/cache-line\tmedian/futex\tinterval µs\t")
	failed := false
	for _, r := range rows {
		if r.err != nil {
			failed = true
			fmt.Fprintf(tw, "%s\t%d\tFAILED: %v\t\t\t\t\t\t\t\t\n", r.mode, r.readers, r.err)
			continue
		}
		fmt.Fprintf(tw, "%s\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.1f\t%.1fx\t%.2fx\t%.1f\t\n", r.mode, r.readers, r.st.n,
			r.st.median, r.st.p99, r.st.p999, r.st.max, r.st.median/cache.median, r.st.median/fut.median,
			float64(r.interval)/1e3)
	}
	tw.Flush()
	for _, r := range rows {
		if r.err == nil && r.st.missed > 0 {
			fmt.Printf("warning: %s/%d: readers missed %d batches\n", r.mode, r.readers, r.st.missed)
		}
	}
	fmt.Printf("\nspin: readers busy-poll (Spin 1 s); futex: readers never spin (always FUTEX_WAIT).\n")
	for _, r := range rows {
		if r.mode == "spin" && r.readers+1 > runtime.NumCPU() {
			fmt.Printf("note: spin with %d readers keeps %d processes busy on %d CPUs: readers wait for a time slice.\n",
				r.readers, r.readers+1, runtime.NumCPU())
			break
		}
	}
	fmt.Printf("total %.1f s\n", time.Since(start).Seconds())
	if failed {
		return errors.New("some measurements failed")
	}
	return nil
}

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
	"encoding/json"
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
	perRead  time.Duration // pacing grows by this per reader
	payload  uint64        // bytes per batch
	maxTime  time.Duration // cap of one measurement
	paceSpin bool          // the publisher busy-waits between batches
	quick    bool

	helper     string   // C helper (helper/tbench.c); "" = Go readers, no socket baselines
	helperZmq  bool     // the helper has the ZMQ roles
	transports []string // latency: tsock, uds, zmq

	throughput     bool
	tputReaders    []int
	tputTime       time.Duration
	bwSizes        []uint64 // bandwidth batch sizes, bytes
	repeats        int
	scaleReaders   []int
	scalePublishes int
	shm            bool
	jsonPath       string
	pairs          int // rounds of baseline-then-tsock pairs, 1 reader
}

// intervalFor is the publish interval with n readers: readers woken one
// after the other on few CPUs need time to drain each batch.
func (c config) intervalFor(n int) time.Duration {
	return max(c.interval, time.Duration(n)*c.perRead)
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
	perRead := fs.Duration("interval-per-reader", 0, "with N readers publish every max(interval, N x this)")
	payload := fs.Uint64("payload", 64, "payload bytes per batch")
	maxTime := fs.Duration("max-time", 8*time.Second, "cap of one measurement (--quick: 1.5s)")
	paceSpin := fs.Bool("pace-spin", false, "publisher busy-waits between batches instead of sleeping (costs a CPU)")
	quick := fs.Bool("quick", false, "CI smoke run: fewer samples, under 10 s in all")
	helper := fs.String("helper", "", "C reader and socket-baseline program: 'auto' builds helper/tbench.c; empty: Go readers only")
	transports := fs.String("transports", "tsock", "latency of: tsock, uds (descriptor over a Unix socket), zmq (payload over ZMQ PUB/SUB); uds and zmq need --helper")
	tput := fs.Bool("throughput", false, "also batches/s of 4 KiB batches and bandwidth of --bw-sizes batches (needs --helper)")
	tputReaders := fs.String("tput-readers", "1,4", "reader counts of the throughput runs")
	tputTime := fs.Duration("tput-time", 500*time.Millisecond, "length of one throughput run (--quick: 200ms)")
	bwSizes := fs.String("bw-sizes", "1,8,64", "bandwidth batch sizes in MiB (--quick: 1,8)")
	repeats := fs.Int("repeats", 3, "throughput repeats, the median is kept (--quick: 1)")
	scale := fs.String("scaling", "", "producer CPU per publish with these reader counts (0 = none to wake), e.g. 0,1,4,16,64")
	scalePub := fs.Int("scale-publishes", 400, "publishes timed per reader count (--quick: 100)")
	shm := fs.Bool("shm", false, "also shared memory per ring depth and batch size")
	jsonPath := fs.String("json", "", "also write every result to this JSON file")
	pairs := fs.Int("pairs", 0, "rounds of back-to-back pairs (cache-line, tsock spin; futex, tsock futex; 1 reader), for ratios that a vCPU moving between runs cannot skew")
	if err := fs.Parse(args); err != nil {
		return config{}, err
	}
	if fs.NArg() != 0 {
		return config{}, fmt.Errorf("unexpected arguments %q", fs.Args())
	}
	set := map[string]bool{}
	fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
	cfg := config{samples: *samples, warmup: *warmup, interval: *interval, perRead: *perRead, payload: *payload,
		maxTime: *maxTime, paceSpin: *paceSpin, quick: *quick, helper: *helper, throughput: *tput,
		tputTime: *tputTime, repeats: *repeats, scalePublishes: *scalePub, shm: *shm, jsonPath: *jsonPath,
		pairs: *pairs}
	if cfg.quick {
		if !set["samples"] {
			cfg.samples = 2000
		}
		if !set["max-time"] {
			cfg.maxTime = 1500 * time.Millisecond
		}
		if !set["tput-time"] {
			cfg.tputTime = 200 * time.Millisecond
		}
		if !set["bw-sizes"] {
			*bwSizes = "1,8"
		}
		if !set["repeats"] {
			cfg.repeats = 1
		}
		if !set["scale-publishes"] {
			cfg.scalePublishes = 100
		}
	}
	var err error
	if cfg.readers, err = intList("readers", *readers, 1, 256); err != nil {
		return config{}, err
	}
	if cfg.tputReaders, err = intList("tput-readers", *tputReaders, 1, 256); err != nil {
		return config{}, err
	}
	if *scale != "" {
		if cfg.scaleReaders, err = intList("scaling", *scale, 0, 256); err != nil {
			return config{}, err
		}
	}
	mib, err := intList("bw-sizes", *bwSizes, 1, 1024)
	if err != nil {
		return config{}, err
	}
	for _, m := range mib {
		cfg.bwSizes = append(cfg.bwSizes, uint64(m)<<20)
	}
	for _, m := range strings.Split(*modes, ",") {
		m = strings.TrimSpace(m)
		if m != "spin" && m != "futex" {
			return config{}, fmt.Errorf("--modes: unknown mode %q (spin, futex)", m)
		}
		cfg.modes = append(cfg.modes, m)
	}
	for _, t := range strings.Split(*transports, ",") {
		t = strings.TrimSpace(t)
		if t != "tsock" && t != "uds" && t != "zmq" {
			return config{}, fmt.Errorf("--transports: unknown transport %q (tsock, uds, zmq)", t)
		}
		if t != "tsock" && cfg.helper == "" {
			return config{}, fmt.Errorf("--transports %s needs --helper", t)
		}
		cfg.transports = append(cfg.transports, t)
	}
	if (cfg.throughput || len(cfg.scaleReaders) > 0) && cfg.helper == "" {
		return config{}, fmt.Errorf("--throughput and --scaling need --helper (C reader processes)")
	}
	if cfg.samples < 1 || cfg.warmup < 0 || cfg.interval <= 0 || cfg.payload < 8 || cfg.maxTime <= 0 ||
		cfg.repeats < 1 || cfg.tputTime <= 0 || cfg.scalePublishes < 10 || cfg.perRead < 0 || cfg.pairs < 0 {
		return config{}, fmt.Errorf("--samples, --interval, --max-time, --repeats, --tput-time must be positive, --payload at least 8, --scale-publishes at least 10")
	}
	return cfg, nil
}

// intList parses a comma-separated list of integers in [lo, hi].
func intList(flagName, s string, lo, hi int) ([]int, error) {
	var out []int
	for _, f := range strings.Split(s, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < lo || n > hi {
			return nil, fmt.Errorf("--%s: %q is not a count in %d..%d", flagName, f, lo, hi)
		}
		out = append(out, n)
	}
	return out, nil
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

// tsockRow is one latency configuration's result.
type tsockRow struct {
	transport string
	mode      string
	readers   int
	st        stats
	interval  time.Duration // achieved mean publish interval (tsock), pacing (sockets)
	err       error
}

// statsJSON is stats in the JSON report (µs; n = 0 when nothing was measured).
type statsJSON struct {
	N      int     `json:"n"`
	Median float64 `json:"median_us"`
	P99    float64 `json:"p99_us"`
	P999   float64 `json:"p999_us"`
	Max    float64 `json:"max_us"`
	Missed int     `json:"missed"`
}

func (s stats) json() statsJSON {
	if s.n == 0 {
		return statsJSON{}
	}
	return statsJSON{N: s.n, Median: s.median, P99: s.p99, P999: s.p999, Max: s.max, Missed: s.missed}
}

type latJSON struct {
	Transport  string  `json:"transport"`
	Mode       string  `json:"mode"`
	Readers    int     `json:"readers"`
	IntervalUs float64 `json:"interval_us"`
	statsJSON
	Err string `json:"error,omitempty"`
}

// report is everything measured, as --json writes it.
type report struct {
	Machine    string     `json:"machine"`
	GoVersion  string     `json:"go"`
	Cores      int        `json:"cpus"`
	Seconds    float64    `json:"seconds"`
	Payload    uint64     `json:"latency_payload_bytes"`
	CacheLine  statsJSON  `json:"cache_line"`
	Futex      statsJSON  `json:"futex"`    // waiter: C with --helper, else Go
	FutexGo    statsJSON  `json:"futex_go"` // Go waiter, with --helper
	Latency    []latJSON  `json:"latency"`
	Throughput []tputRow  `json:"throughput"`
	Memory     []memRow   `json:"memcpy"`
	Pairs      []pairRow  `json:"pairs"`
	ReadCost   []costRow  `json:"read_cost"`
	Scaling    []scaleRow `json:"scaling"`
	Flat       []flatRow  `json:"flat"`
	Shm        []shmRow   `json:"shm"`
}

func benchMain(cfg config) error {
	start := time.Now()
	vdsoNs, syscallNs, err := checkClock()
	if err != nil {
		return err
	}
	if cfg.helper == "auto" {
		dir, err := os.MkdirTemp("", "tsock-bench-")
		if err != nil {
			return err
		}
		defer os.RemoveAll(dir)
		if cfg.helper, cfg.helperZmq, err = buildHelper(repoRoot(), dir); err != nil {
			return err
		}
	} else if cfg.helper != "" {
		cfg.helperZmq = true // a prebuilt helper without libzmq fails the ZMQ runs with its usage line
	}
	rep := report{Machine: machine(), GoVersion: runtime.Version(), Cores: runtime.NumCPU(), Payload: cfg.payload}
	fmt.Printf("machine: %s\n", rep.Machine)
	fmt.Printf("clock:   CLOCK_MONOTONIC; %.0f ns per vDSO read, %.0f ns per clock_gettime syscall (ring.MonotonicNs)\n",
		vdsoNs, syscallNs)
	pacing := "sleeping"
	if cfg.paceSpin {
		pacing = "busy-waiting"
	}
	readerKind := "Go readers (reader package)"
	if cfg.helper != "" {
		readerKind = "C reader processes (helper/tbench.c)"
	}
	fmt.Printf("run:     %d samples per reader (+%d warm-up), one %d-byte batch every max(%v, readers x %v) (publisher %s in between), at most %v per measurement; %s\n\n",
		cfg.samples, cfg.warmup, cfg.payload, cfg.interval, cfg.perRead, pacing, cfg.maxTime, readerKind)

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
	rep.CacheLine, rep.Futex = cache.json(), fut.json()
	var futGo stats
	if cfg.helper != "" {
		// The same with the Go waiter, for comparison: its runtime's
		// threads keep its CPU from idling, so its wake-ups are faster.
		goCfg := cfg
		goCfg.helper = ""
		shm.reset()
		if futGo, err = futexBaseline(goCfg, shm); err != nil {
			return fmt.Errorf("futex baseline (Go waiter): %w", err)
		}
		rep.FutexGo = futGo.json()
	}

	if cfg.pairs > 0 {
		if rep.Pairs, err = pairedRounds(cfg, shm); err != nil {
			return err
		}
	}
	var rows []tsockRow
	for _, tr := range cfg.transports {
		for _, mode := range cfg.modes {
			for _, r := range cfg.readers {
				var st stats
				var iv time.Duration
				if tr == "tsock" {
					st, iv, err = tsockLatency(cfg, mode, r)
				} else {
					st, iv, err = socketLatency(cfg, tr, mode, r)
				}
				rows = append(rows, tsockRow{transport: tr, mode: mode, readers: r, st: st, interval: iv, err: err})
				row := latJSON{Transport: tr, Mode: mode, Readers: r, IntervalUs: float64(iv) / 1e3, statsJSON: st.json()}
				if err != nil {
					row.Err = err.Error()
				}
				rep.Latency = append(rep.Latency, row)
			}
		}
	}
	if cfg.throughput {
		for _, tr := range []string{"tsock", "uds", "zmq"} {
			for _, r := range cfg.tputReaders {
				rep.Throughput = append(rep.Throughput, throughput(cfg, tr, r, 4096, 16, false))
			}
		}
		// Reading cost against batch size: the same ring depth, payload not read.
		// Sizes interleaved, repeats outside: load that comes and goes hits
		// every size alike; each size keeps its median repeat.
		sizes := append([]uint64{4096}, cfg.bwSizes...)
		runs := make([][]costRow, len(sizes))
		for i := 0; i < cfg.repeats+2*min(1, cfg.repeats-1); i++ { // 5 for 3: cheap, and near a threshold
			for j, size := range sizes {
				runs[j] = append(runs[j], readCost(cfg, size))
			}
		}
		for _, r := range runs {
			rep.ReadCost = append(rep.ReadCost, medianCost(r))
		}
		for _, size := range cfg.bwSizes {
			m, err := memBandwidth(cfg, size, slotsFor(size))
			if err != nil {
				return fmt.Errorf("memcpy baseline: %w", err)
			}
			rep.Memory = append(rep.Memory, m)
			for _, tr := range []string{"tsock", "zmq"} {
				for _, r := range cfg.tputReaders {
					rep.Throughput = append(rep.Throughput, throughput(cfg, tr, r, size, slotsFor(size), true))
				}
			}
		}
	}
	for _, n := range cfg.scaleReaders {
		rep.Scaling = append(rep.Scaling, producerCost(cfg, n))
	}
	for _, n := range cfg.scaleReaders {
		if n > 0 {
			rep.Flat = append(rep.Flat, producerFlat(cfg, n))
		}
	}
	if cfg.shm {
		for _, slots := range []uint32{4, 16, 64} {
			for _, size := range []uint64{4 << 10, 1 << 20, 8 << 20} {
				rep.Shm = append(rep.Shm, shmSize(slots, size))
			}
		}
	}
	rep.Seconds = time.Since(start).Seconds()
	failed := printReport(cfg, rep, cache, fut, futGo, rows)
	fmt.Printf("total %.1f s\n", rep.Seconds)
	if cfg.jsonPath != "" {
		b, err := json.MarshalIndent(rep, "", "  ")
		if err != nil {
			return err
		}
		if err := os.WriteFile(cfg.jsonPath, append(b, '\n'), 0o644); err != nil {
			return err
		}
	}
	if failed {
		return errors.New("some measurements failed")
	}
	return nil
}

// printReport prints the tables; it returns whether anything failed.
func printReport(cfg config, rep report, cache, fut, futGo stats, rows []tsockRow) bool {
	tw := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "baseline (one-way)\tsamples\tmedian µs\tp99 µs\tp99.9 µs\tmax µs\t")
	fmt.Fprintf(tw, "cache-line handoff (RTT/2)\t%d\t%.3f\t%.3f\t%.3f\t%.1f\t\n", cache.n, cache.median, cache.p99, cache.p999, cache.max)
	fmt.Fprintf(tw, "futex wake -> waiter runs\t%d\t%.2f\t%.2f\t%.2f\t%.1f\t\n", fut.n, fut.median, fut.p99, fut.p999, fut.max)
	if futGo.n > 0 {
		fmt.Fprintf(tw, "(the same, Go waiter)\t%d\t%.2f\t%.2f\t%.2f\t%.1f\t\n", futGo.n, futGo.median, futGo.p99, futGo.p999, futGo.max)
	}
	tw.Flush()
	if fut.lateWakeup > 0 {
		fmt.Printf("(futex baseline: %d wake-ups found the waiter not yet asleep; not counted)\n", fut.lateWakeup)
	}
	fmt.Println()

	tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "publish -> receive\tmode\treaders\tsamples\tmedian µs\tp99 µs\tp99.9 µs\tmax µs\tmedian/cache-line\tmedian/futex\tinterval µs\t")
	failed := false
	for _, r := range rows {
		if r.err != nil {
			failed = true
			fmt.Fprintf(tw, "%s\t%s\t%d\tFAILED: %v\t\t\t\t\t\t\t\t\n", r.transport, r.mode, r.readers, r.err)
			continue
		}
		fmt.Fprintf(tw, "%s\t%s\t%d\t%d\t%.2f\t%.2f\t%.2f\t%.1f\t%.1fx\t%.2fx\t%.1f\t\n", r.transport, r.mode, r.readers, r.st.n,
			r.st.median, r.st.p99, r.st.p999, r.st.max, r.st.median/cache.median, r.st.median/fut.median,
			float64(r.interval)/1e3)
	}
	tw.Flush()
	for _, r := range rows {
		if r.err == nil && r.st.missed > 0 {
			fmt.Printf("warning: %s %s/%d: readers missed %d batches\n", r.transport, r.mode, r.readers, r.st.missed)
		}
	}
	fmt.Printf("\nspin: readers busy-poll (Spin 1 s); futex: readers never spin (always FUTEX_WAIT, or a blocking recv).\n")
	for _, r := range rows {
		if r.mode == "spin" && r.readers+1 > runtime.NumCPU() {
			fmt.Printf("note: spin with %d readers keeps %d processes busy on %d CPUs: readers wait for a time slice.\n",
				r.readers, r.readers+1, runtime.NumCPU())
			break
		}
	}
	if len(rep.Throughput) > 0 {
		fmt.Println()
		tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "flat out\treaders\tbatch\ttouch\tbatches/s per reader\tGB/s per reader\tmissed\t")
		for _, t := range rep.Throughput {
			if t.Err != "" {
				failed = true
				fmt.Fprintf(tw, "%s\t%d\t%d\t%v\tFAILED: %s\t\t\t\n", t.Transport, t.Readers, t.Bytes, t.Touch, t.Err)
				continue
			}
			fmt.Fprintf(tw, "%s\t%d\t%d\t%v\t%.0f\t%.2f\t%d\t\n", t.Transport, t.Readers, t.Bytes, t.Touch, t.BatchesPerS, t.GBPerS, t.Missed)
		}
		tw.Flush()
		for _, m := range rep.Memory {
			fmt.Printf("in-process %d MiB batches from a ring of %d: memcpy %.2f GB/s, read %.2f GB/s\n",
				m.Bytes>>20, m.Slots, m.MemcpyGBps, m.ReadGBps)
		}
	}
	if len(rep.Pairs) > 0 {
		fmt.Println()
		for i, p := range rep.Pairs {
			fmt.Printf("pair %d: cache-line %.3f µs, tsock spin %.3f µs (%.1fx); futex %.2f µs, tsock futex %.2f µs (%.2fx)\n",
				i+1, p.CacheLine, p.Spin, p.Spin/p.CacheLine, p.Futex, p.FutexTsock, p.FutexTsock/p.Futex)
		}
	}
	if len(rep.ReadCost) > 0 {
		fmt.Println()
		for _, r := range rep.ReadCost {
			if r.Err != "" {
				failed = true
				fmt.Printf("reading cost, %d-byte batches: FAILED: %s\n", r.Bytes, r.Err)
				continue
			}
			fmt.Printf("reading cost, %d-byte batches: acquire + release %.0f ns (median of %d; mean to p90 %.1f ns), p99 %.0f ns\n",
				r.Bytes, r.MedianNs, r.Samples, r.MeanNs, r.P99Ns)
		}
	}
	if len(rep.Scaling) > 0 {
		fmt.Println()
		tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "sleeping readers\tpublishes\tproducer CPU µs/publish (median)\tmean\twall µs (median)\tinterval µs\t")
		for _, r := range rep.Scaling {
			if r.Err != "" {
				failed = true
				fmt.Fprintf(tw, "%d\tFAILED: %s\t\t\t\t\t\n", r.Readers, r.Err)
				continue
			}
			fmt.Fprintf(tw, "%d\t%d\t%.2f\t%.2f\t%.2f\t%.0f\t\n", r.Readers, r.Publishes, r.CPUMedian, r.CPUMean, r.WallMedian, r.Interval)
		}
		tw.Flush()
	}
	if len(rep.Flat) > 0 {
		fmt.Println()
		tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "flat out, readers\tpublishes/s\tproducer CPU µs/publish\tback-pressure µs/publish\t")
		for _, r := range rep.Flat {
			if r.Err != "" {
				failed = true
				fmt.Fprintf(tw, "%d\tFAILED: %s\t\t\t\n", r.Readers, r.Err)
				continue
			}
			fmt.Fprintf(tw, "%d\t%.0f\t%.2f\t%.1f\t\n", r.Readers, r.PublishesPerS, r.CPUPerPublish, r.BackpressureUs)
		}
		tw.Flush()
	}
	if len(rep.Shm) > 0 {
		fmt.Println()
		tw = tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight)
		fmt.Fprintln(tw, "slots\tslot bytes\tcomputed\tfile size\tallocated after one lap\toverhead over payload\t")
		for _, r := range rep.Shm {
			if r.Err != "" {
				failed = true
				fmt.Fprintf(tw, "%d\t%d\tFAILED: %s\t\t\t\t\n", r.Slots, r.SlotBytes, r.Err)
				continue
			}
			fmt.Fprintf(tw, "%d\t%d\t%d\t%d\t%d\t%d\t\n", r.Slots, r.SlotBytes, r.Computed, r.FileSize, r.Allocated, r.FileSize-r.Payload)
		}
		tw.Flush()
	}
	return failed
}

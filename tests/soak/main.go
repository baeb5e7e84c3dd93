// Command soak is tsock's chaos soak: one producer process and N reader
// processes (C readers built from creader/soak_reader.c and Go readers,
// this binary re-executed) on one channel while, every --chaos-every, at
// random:
//
//   - a reader is SIGKILLed and restarted (it joins with StartNow);
//   - a reader is SIGSTOPped for up to --stop-max, then SIGCONTed;
//   - a reader is stopped until the producer is gated on it alone, then
//     SIGKILLed, and the time from its death (seen reaped) to the next
//     publish is measured (the liveness bound: the producer must notice the
//     death at once);
//
// and every --producer-every the producer is SIGKILLed and restarted: the
// readers must read everything the dead producer published, report
// "producer gone" within --gone-bound of the kill, attach to the new
// producer (AttachTimeout) and go on; the new producer must take the name
// at its first Create.
//
// The producer is in turn the C one (creader's twin, cproducer/soak_producer.c
// on libtsock.so, built here) and the Go one (this binary re-executed), or
// one of them with --producer. With --fork (the default) the C producer and
// the C and Python readers fork children without exec that outlive them
// (--fork-every, --fork-life), as DataLoader workers and trainers' helpers
// do: the soak checks that such children, alive at the kill of their
// parent, change nothing above (the kill-to-publish bound, "producer gone"
// within the bound, the name taken at once, every record free at the end).
//
// Every reader verifies every batch (content and checksum of the
// internal/batchgen format, consecutive sequence numbers and batch
// counters within an attachment, a later producer incarnation after a
// re-attach). At the end the readers leave (half detach, half are killed),
// the producer publishes two rings' worth (reclaiming dead readers'
// records), every reader record must be free and unlocked, the producer
// closes, and no file may be left in /dev/shm.
//
// With --device the producer keeps a device pool (on the fake CUDA driver
// of tests/c/fake_cuda.c, built here, or with --libcuda on a real one) and
// the C readers read every batch on the device path as well: the device
// copy must equal the host copy, and a slow read queued on the GPU before
// each release must still see its batch when it runs (fences under chaos).
// After a producer's death they fall back to the host copies.
//
// Usage:
//
//	go run ./tests/soak [--duration 10m] [--readers 8] [--c-readers 3] [--fork=false] [--json]
//
// Exit status 0 when every check passed, 1 otherwise, 2 for a bad command
// line.
package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/tsock/tsock/internal/childproc"
	"github.com/tsock/tsock/ring"
)

// asMainEnv makes a test binary behave as this command (see soak_test.go).
const asMainEnv = "TSOCK_SOAK_AS_MAIN"

func main() {
	os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
}

type config struct {
	duration      time.Duration
	readers       int
	cReaders      int
	pyReaders     int
	slots         uint
	rate          int
	chaosEvery    time.Duration
	producerEvery time.Duration
	stopMax       time.Duration
	livenessBound time.Duration
	statusEvery   time.Duration
	seed          uint64
	name          string
	cReader       string
	repo          string
	jsonOut       bool
	device        bool
	libcuda       string
	producer      string // "mixed", "c" or "go"
	fork          bool
	forkEvery     time.Duration
	forkLife      time.Duration
	goneBound     time.Duration
}

func realMain(args []string, stdout, stderr io.Writer) int {
	if len(args) > 0 {
		switch args[0] {
		case "producer":
			return runProducerRole(args[1:])
		case "reader":
			return runReaderRole(args[1:])
		}
	}
	cfg := config{}
	fs := flag.NewFlagSet("soak", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.DurationVar(&cfg.duration, "duration", 10*time.Minute, "how long to run the chaos")
	fs.IntVar(&cfg.readers, "readers", 8, "reader processes")
	fs.IntVar(&cfg.cReaders, "c-readers", 3, "how many of the readers are C")
	fs.IntVar(&cfg.pyReaders, "py-readers", 2,
		"how many of the readers are Python (the others are Go; none when .venv/bin/python or the reader library is missing)")
	fs.UintVar(&cfg.slots, "slots", 16, "ring depth")
	fs.IntVar(&cfg.rate, "rate", 2000, "producer batches per second (0: as fast as the readers allow)")
	fs.DurationVar(&cfg.chaosEvery, "chaos-every", 100*time.Millisecond, "mean time between reader kills/stops")
	fs.DurationVar(&cfg.producerEvery, "producer-every", 30*time.Second, "mean time between producer kills (0: never)")
	fs.DurationVar(&cfg.stopMax, "stop-max", 300*time.Millisecond, "longest SIGSTOP of a reader")
	fs.DurationVar(&cfg.livenessBound, "liveness-bound", time.Second,
		"longest allowed time from the death of the gating reader to the next publish")
	fs.DurationVar(&cfg.statusEvery, "status-every", 10*time.Second, "print a status line this often")
	fs.Uint64Var(&cfg.seed, "seed", 0, "random seed (0: from the clock)")
	fs.StringVar(&cfg.name, "name", "", "channel name (default soak-<pid>)")
	fs.StringVar(&cfg.cReader, "c-reader", "", "prebuilt creader/soak_reader (default: build it with cc)")
	fs.StringVar(&cfg.repo, "repo", "", "repository root, to build the C reader (default: where this source is)")
	fs.BoolVar(&cfg.jsonOut, "json", false, "print the result as JSON")
	fs.BoolVar(&cfg.device, "device", false, "device pool and C readers on the device path (fake CUDA driver)")
	fs.StringVar(&cfg.libcuda, "libcuda", "", "with --device: the CUDA driver to use (default: build the fake)")
	fs.StringVar(&cfg.producer, "producer", "mixed",
		"producer program: mixed (C and Go in turn, C first), c (on libtsock.so) or go")
	fs.BoolVar(&cfg.fork, "fork", true,
		"the C producer and the C and Python readers fork children without exec that outlive them")
	fs.DurationVar(&cfg.forkEvery, "fork-every", time.Second, "with --fork: a forking process forks this often (and at start)")
	fs.DurationVar(&cfg.forkLife, "fork-life", 5*time.Second, "with --fork: how long each forked child lives")
	fs.DurationVar(&cfg.goneBound, "gone-bound", time.Second,
		"longest allowed time from a producer's death to \"producer gone\" in each of its readers")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return 0
		}
		return 2
	}
	if fs.NArg() != 0 || cfg.readers < 1 || cfg.cReaders < 0 || cfg.pyReaders < 0 ||
		cfg.cReaders+cfg.pyReaders > cfg.readers || cfg.duration <= 0 ||
		cfg.chaosEvery <= 0 || cfg.slots < 2 || (cfg.producer != "mixed" && cfg.producer != "c" && cfg.producer != "go") ||
		(cfg.fork && (cfg.forkEvery <= 0 || cfg.forkLife <= 0)) {
		fmt.Fprintln(stderr, "soak: bad arguments (see -h)")
		return 2
	}
	if cfg.seed == 0 {
		cfg.seed = uint64(time.Now().UnixNano())
	}
	if cfg.name == "" {
		cfg.name = fmt.Sprintf("soak-%d", os.Getpid())
	}
	res := runSoak(cfg, stderr)
	if cfg.jsonOut {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(res)
	} else {
		printResult(stdout, cfg, res)
	}
	if !res.OK {
		return 1
	}
	return 0
}

// Result is the outcome of a soak (also its --json output).
type Result struct {
	OK               bool                   `json:"ok"`
	Failures         []string               `json:"failures,omitempty"`
	Seconds          float64                `json:"seconds"`
	Seed             uint64                 `json:"seed"`
	Readers          int                    `json:"readers"`
	CReaders         int                    `json:"c_readers"`
	PyReaders        int                    `json:"py_readers"`
	GoReaders        int                    `json:"go_readers"`
	PyFallback       string                 `json:"py_fallback,omitempty"` // why there are no Python readers
	Kinds            map[string]*KindCounts `json:"kinds,omitempty"`       // per reader kind: "c", "go", "python"
	Kills            int                    `json:"reader_kills"`
	GatingKills      int                    `json:"gating_kills"` // kills of the reader the producer waited for, measured
	Stops            int                    `json:"reader_stops"`
	Restarts         int                    `json:"reader_restarts"`
	ProducerRestarts int                    `json:"producer_restarts"`
	Published        uint64                 `json:"batches_published"` // all incarnations, epoch markers included
	Verified         uint64                 `json:"batches_verified"`  // data batches checked by readers, all processes
	GoneChecks       int                    `json:"producer_gone_checks"`
	Reattaches       int                    `json:"reattaches"`
	LatencyP50Ms     float64                `json:"kill_to_publish_p50_ms"`
	LatencyP99Ms     float64                `json:"kill_to_publish_p99_ms"`
	LatencyMaxMs     float64                `json:"kill_to_publish_max_ms"`
	RecordsChecked   int                    `json:"records_checked"`
	CBuild           string                 `json:"c_reader,omitempty"`
	Device           string                 `json:"device_driver,omitempty"` // --device: the libcuda used
	DeviceVerified   uint64                 `json:"device_batches_verified"` // device copies checked by C readers
	DeviceReads      uint64                 `json:"device_reads_verified"`   // queued GPU reads that saw their batch

	// Producers and forked children (issue 17).
	Forking            bool    `json:"forking"`
	CProducers         int     `json:"c_producer_incarnations"`  // incarnations run by the C producer
	GoProducers        int     `json:"go_producer_incarnations"` // by the Go producer
	ProducerForks      int     `json:"producer_forks"`           // children forked by C producers
	ReaderForks        int     `json:"reader_forks"`             // by C and Python readers
	GatingKillsChild   int     `json:"gating_kills_with_child"`  // measured gating kills whose reader had a forked child alive throughout
	ChildLatencyMaxMs  float64 `json:"gating_kills_with_child_max_ms"`
	GoneTimed          int     `json:"gone_timed"` // readers timed from their producer's kill to "producer gone"
	GoneP50Ms          float64 `json:"kill_to_gone_p50_ms"`
	GoneP99Ms          float64 `json:"kill_to_gone_p99_ms"`
	GoneMaxMs          float64 `json:"kill_to_gone_max_ms"`
	GoneRawMaxMs       float64 `json:"kill_to_gone_with_backlog_max_ms"` // also counting the backlog a reader read first
	ProducerKillsChild int     `json:"producer_kills_with_child"`        // producer kills with a forked child alive until the next producer had the name
	CreateMaxMs        float64 `json:"create_max_ms"`                    // longest Create of a new producer on the dead one's name
	ChildrenAtEnd      int     `json:"children_alive_at_end"`            // forked children alive when the records were checked
}

// KindCounts are the counts of one kind of reader ("c", "go", "python").
type KindCounts struct {
	Slots      int    `json:"slots"`     // readers of this kind at any time
	Processes  int    `json:"processes"` // reader processes started
	Kills      int    `json:"kills"`
	Stops      int    `json:"stops"`
	Verified   uint64 `json:"batches_verified"`
	Reattaches int    `json:"reattaches"`
	Forks      int    `json:"forks"` // children forked without exec
}

// kindOf is the counts of c's kind (main loop only; result() reads them).
func (s *soak) kindOf(c *child) *KindCounts {
	s.mu.Lock()
	defer s.mu.Unlock()
	k := s.res.Kinds[c.kind]
	if k == nil {
		k = &KindCounts{}
		s.res.Kinds[c.kind] = k
	}
	return k
}

// child is one process of the soak.
type child struct {
	kind   string // "producer", "c", "go", "python"
	slot   int
	slowUs int
	proc   *childproc.Process
	cmd    *exec.Cmd      // proc.Cmd
	stdin  io.WriteCloser // producer: its commands
	done   <-chan struct{}
	lines  chan string // producer: its replies

	// set by the main loop only
	killed    bool // by us: its exit is expected
	stopped   bool
	stopUntil time.Time

	// set by the output reader, under soak.mu
	n           uint64
	devN, reads uint64    // device copies and queued GPU reads verified (C readers, --device)
	lastMove    time.Time // when n last grew
	attaches    int
	gones       int           // "gone" lines
	goneMono    time.Duration // CLOCK_MONOTONIC of the last "gone"
	drainedMono time.Duration // and of the end of its last batch before it
	forks       int           // children it forked
	createTime  time.Duration // producer: how long its Create took
	fatal       string        // MISMATCH or error line
	finalLine   string
	lastOutputs []string
}

func (c *child) pid() int { return c.cmd.Process.Pid }

func (c *child) exited() bool { return c.proc.Exited() }

type goneReport struct {
	c       *child
	inc     int64
	lastSeq int64
}

type soak struct {
	cfg     config
	log     io.Writer
	self    string
	cReader string
	python  string // venv python of the Python readers
	cProd   string // the C producer, cproducer/soak_producer.c on libtsock.so
	pyEnv   []string
	cudaEnv []string // --device: TSOCK_LIBCUDA for every child
	rnd     *rand.Rand

	mu         sync.Mutex
	readers    []*child // current reader of each slot
	history    []*child // every reader process started
	pending    []goneReport
	finals     map[int64]uint64 // incarnation -> batches it published
	failures   []string
	res        Result
	latencies  []time.Duration
	childLat   []time.Duration // gating kills of readers with a forked child alive
	goneLat    []time.Duration // producer kill (or a reader's last batch after it) to its "producer gone"
	goneRawMax time.Duration   // the longest from the kill itself
	createMax  time.Duration
	forks      []*forked // forked children followed (forks.go)

	prod      *child
	inc       int64
	prodPids  []int
	producers []*child // every producer started
	seg       *ring.Segment
	tmpDir    string
	stopwatch time.Time
}

func (s *soak) fail(format string, args ...any) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.failures = append(s.failures, fmt.Sprintf(format, args...))
}

func (s *soak) failed() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.failures) > 0
}

func runSoak(cfg config, log io.Writer) Result {
	s := &soak{cfg: cfg, log: childproc.Serialized(log), rnd: rand.New(rand.NewPCG(cfg.seed, 0x50a4)),
		finals: map[int64]uint64{}}
	s.res = Result{Seed: cfg.seed, Readers: cfg.readers, CReaders: cfg.cReaders, PyReaders: cfg.pyReaders,
		Kinds: map[string]*KindCounts{}, Forking: cfg.fork}
	// Pdeathsig follows the thread that started a child: keep this
	// goroutine, which starts them all, on one thread.
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	s.stopwatch = time.Now()
	// The forked children of a killed reader or producer become ours, to
	// be reaped (and killed at the end) here.
	if err := setSubreaper(true); err != nil {
		s.fail("setup: PR_SET_CHILD_SUBREAPER: %v", err)
		return s.result()
	}
	defer setSubreaper(false)
	defer s.cleanup()
	if err := s.setup(); err != nil {
		s.fail("setup: %v", err)
		return s.result()
	}
	s.chaos()
	s.finish()
	return s.result()
}

func (s *soak) result() Result {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := s.res
	r.Seconds = time.Since(s.stopwatch).Seconds()
	r.Failures = s.failures
	r.OK = len(s.failures) == 0
	kinds := map[string]*KindCounts{}
	for kind, k := range s.res.Kinds {
		kk := *k
		kinds[kind] = &kk
	}
	for kind, n := range map[string]int{"c": r.CReaders, "python": r.PyReaders, "go": r.GoReaders} {
		if n > 0 && kinds[kind] == nil {
			kinds[kind] = &KindCounts{}
		}
		if kinds[kind] != nil {
			kinds[kind].Slots = n
		}
	}
	for _, c := range s.history {
		r.Verified += c.n
		r.DeviceVerified += c.devN
		r.DeviceReads += c.reads
		k := kinds[c.kind]
		if k == nil {
			k = &KindCounts{}
			kinds[c.kind] = k
		}
		k.Processes++
		k.Verified += c.n
		k.Forks += c.forks
		if c.attaches > 1 {
			r.Reattaches += c.attaches - 1
			k.Reattaches += c.attaches - 1
		}
	}
	r.Kinds = kinds
	for _, c := range s.history {
		r.ReaderForks += c.forks
	}
	for _, c := range s.producers {
		r.ProducerForks += c.forks
	}
	r.LatencyP50Ms, r.LatencyP99Ms, r.LatencyMaxMs = percentiles(s.latencies)
	_, _, r.ChildLatencyMaxMs = percentiles(s.childLat)
	r.GoneP50Ms, r.GoneP99Ms, r.GoneMaxMs = percentiles(s.goneLat)
	r.GoneTimed = len(s.goneLat)
	r.GoneRawMaxMs = ms(s.goneRawMax)
	r.CreateMaxMs = ms(s.createMax)
	return r
}

func ms(d time.Duration) float64 { return float64(d) / 1e6 }

// percentiles are p50, p99 and the maximum of ds, in milliseconds.
func percentiles(ds []time.Duration) (p50, p99, top float64) {
	n := len(ds)
	if n == 0 {
		return 0, 0, 0
	}
	l := append([]time.Duration(nil), ds...)
	sort.Slice(l, func(i, j int) bool { return l[i] < l[j] })
	return ms(l[n/2]), ms(l[min(n-1, n*99/100)]), ms(l[n-1])
}

// setup finds or builds the C reader, starts the producer and the readers.
func (s *soak) setup() error {
	self, err := os.Executable()
	if err != nil {
		return err
	}
	s.self = self
	if s.tmpDir, err = os.MkdirTemp("", "tsock-soak-"); err != nil {
		return err
	}
	if s.cfg.device {
		if s.cfg.cReaders == 0 {
			return errors.New("--device needs C readers (--c-readers > 0): they read the device copies")
		}
		if err := s.setupDevice(); err != nil {
			return err
		}
	}
	if s.cfg.cReaders > 0 {
		s.cReader = s.cfg.cReader
		if s.cReader == "" {
			if s.cReader, err = s.buildCReader(); err != nil {
				return err
			}
		}
		s.res.CBuild = s.cReader
	}
	if s.cfg.pyReaders > 0 {
		if why := s.setupPython(); why != "" {
			fmt.Fprintf(s.log, "soak: no Python readers: %s\n", why)
			s.res.PyFallback = why
			s.cfg.pyReaders = 0
			s.res.PyReaders = 0
		}
	}
	s.res.GoReaders = s.cfg.readers - s.cfg.cReaders - s.cfg.pyReaders
	if s.cfg.producer != "go" {
		if s.cProd, err = s.buildCProducer(); err != nil {
			return err
		}
	}
	if err := s.startProducer(); err != nil {
		return err
	}
	for k := 0; k < s.cfg.readers; k++ {
		s.readers = append(s.readers, nil)
		if err := s.startReader(k); err != nil {
			return err
		}
	}
	// Wait for every reader to attach.
	deadline := time.Now().Add(60 * time.Second)
	for {
		all := true
		s.mu.Lock()
		for _, c := range s.readers {
			all = all && c.attaches > 0
		}
		s.mu.Unlock()
		if all {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("readers did not attach within 60 s")
		}
		if err := s.checkChildren(); err != nil {
			return err
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func (s *soak) repoRoot() string {
	if s.cfg.repo != "" {
		return s.cfg.repo
	}
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// setupPython finds the venv python and libtsock_reader.so (build/, or built
// here with cc) for the Python readers; it returns why not when it cannot.
func (s *soak) setupPython() string {
	repo, err := filepath.Abs(s.repoRoot())
	if err != nil {
		return err.Error()
	}
	py := filepath.Join(repo, ".venv", "bin", "python")
	if _, err := os.Stat(py); err != nil {
		return fmt.Sprintf("%s not found (make py-env)", py)
	}
	script := filepath.Join(repo, "tests", "soak", "pyreader", "soak_reader.py")
	if _, err := os.Stat(script); err != nil {
		return fmt.Sprintf("Python reader source not found (%v)", err)
	}
	if out, err := exec.Command(py, "-c", "import numpy").CombinedOutput(); err != nil {
		return fmt.Sprintf("%s has no numpy: %v %s", py, err, strings.TrimSpace(string(out)))
	}
	libDir := filepath.Join(repo, "build")
	if _, err := os.Stat(filepath.Join(libDir, "libtsock_reader.so")); err != nil {
		libDir = s.tmpDir
		cc := os.Getenv("CC")
		if cc == "" {
			cc = "cc"
		}
		args := []string{"-shared", "-fPIC", "-O2", "-std=c11", "-I" + filepath.Join(repo, "include"),
			"-I" + filepath.Join(repo, "ring")}
		readerSources, _ := filepath.Glob(filepath.Join(repo, "reader", "*.c")) // as libtsock_reader.so
		args = append(args, readerSources...)
		args = append(args, "-ldl", "-lpthread", "-o", filepath.Join(libDir, "libtsock_reader.so"))
		if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
			return fmt.Sprintf("no build/libtsock_reader.so and building it failed: %v\n%s", err, out)
		}
	}
	s.python = py
	s.pyEnv = []string{"TSOCK_LIBRARY_DIR=" + libDir, "PYTHONPATH=" + filepath.Join(repo, "python"),
		"PYTHONUNBUFFERED=1"}
	return ""
}

// setupDevice points every child at a CUDA driver: --libcuda, or the fake
// driver built here from tests/c/fake_cuda.c.
func (s *soak) setupDevice() error {
	lib := s.cfg.libcuda
	if lib == "" {
		cc := os.Getenv("CC")
		if cc == "" {
			cc = "cc"
		}
		lib = filepath.Join(s.tmpDir, "libfakecuda.so")
		src := filepath.Join(s.repoRoot(), "tests", "c", "fake_cuda.c")
		out, err := exec.Command(cc, "-shared", "-fPIC", "-O2", "-std=gnu11", src, "-lpthread", "-o", lib).CombinedOutput()
		if err != nil {
			return fmt.Errorf("building the fake CUDA driver: %v\n%s", err, out)
		}
	}
	s.cudaEnv = []string{"TSOCK_LIBCUDA=" + lib}
	s.res.Device = lib
	return nil
}

// buildCReader compiles creader/soak_reader.c with the C reader sources.
func (s *soak) buildCReader() (string, error) {
	repo := s.repoRoot()
	src := filepath.Join(repo, "tests", "soak", "creader", "soak_reader.c")
	if _, err := os.Stat(src); err != nil {
		return "", fmt.Errorf("C reader source not found (%v); pass --repo, --c-reader or --c-readers 0", err)
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	exe := filepath.Join(s.tmpDir, "soak_reader")
	args := []string{"-O2", "-std=c11", "-Wall", "-Werror", "-I" + filepath.Join(repo, "include"),
		"-I" + filepath.Join(repo, "ring"), src}
	readerSources, _ := filepath.Glob(filepath.Join(repo, "reader", "*.c")) // as libtsock_reader.so
	args = append(args, readerSources...)
	out, err := exec.Command(cc, append(args, "-ldl", "-lpthread", "-o", exe)...).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("building the C reader: %v\n%s", err, out)
	}
	return exe, nil
}

// buildCProducer builds libtsock.so (go build -buildmode=c-shared ./cabi,
// as tests/mp does) and cproducer/soak_producer.c on it.
func (s *soak) buildCProducer() (string, error) {
	repo := s.repoRoot()
	src := filepath.Join(repo, "tests", "soak", "cproducer", "soak_producer.c")
	if _, err := os.Stat(src); err != nil {
		return "", fmt.Errorf("C producer source not found (%v); pass --repo or --producer go", err)
	}
	build := exec.Command("sh", filepath.Join(repo, "scripts", "cgo.sh"), "go", "build", "-buildmode=c-shared",
		"-buildvcs=false", "-ldflags=-extldflags=-Wl,-soname,libtsock.so", "-o", filepath.Join(s.tmpDir, "libtsock.so"),
		"./cabi")
	build.Dir = repo
	build.Env = append(os.Environ(), "CGO_ENABLED=1")
	if out, err := build.CombinedOutput(); err != nil {
		return "", fmt.Errorf("building libtsock.so: %v\n%s", err, out)
	}
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	exe := filepath.Join(s.tmpDir, "soak_producer")
	out, err := exec.Command(cc, "-O2", "-std=c11", "-Wall", "-Wextra", "-Werror", "-I"+filepath.Join(repo, "include"),
		src, "-L"+s.tmpDir, "-ltsock", "-Wl,-rpath,"+s.tmpDir, "-o", exe).CombinedOutput()
	if err != nil {
		return "", fmt.Errorf("building the C producer: %v\n%s", err, out)
	}
	return exe, nil
}

func (s *soak) start(c *child, name string, args ...string) error {
	env := append([]string{asMainEnv + "=1"}, s.cudaEnv...)
	if c.kind == "python" {
		env = append(env, s.pyEnv...)
	}
	if c.kind == "producer" {
		c.lines = make(chan string, 64)
	}
	p, err := childproc.Start(name, args, childproc.Options{Label: c.kind, Env: env, Stderr: s.log,
		Stdin: c.kind == "producer", OnLine: func(l string) { s.onLine(c, l) }, Keep: keptOutput})
	if err != nil {
		return err
	}
	c.proc, c.cmd, c.stdin, c.done = p, p.Cmd, p.Stdin, p.Done()
	return nil
}

// keptOutput bounds what is kept of a child's output (it runs for minutes;
// its lines are handled as they come).
const keptOutput = 16 << 10

// onLine handles one output line of a child (its output goroutine).
func (s *soak) onLine(c *child, l string) {
	if v, ok := strings.CutPrefix(l, "forked pid="); ok {
		pid, err := strconv.Atoi(v)
		s.mu.Lock()
		defer s.mu.Unlock()
		if err != nil || pid <= 0 {
			s.failures = append(s.failures, fmt.Sprintf("%s: bad line %q", c.label(), l))
			return
		}
		s.onForked(c, pid)
		return
	}
	if c.kind == "producer" {
		if v, ok := strings.CutPrefix(l, "created ns="); ok {
			ns, _ := strconv.ParseInt(v, 10, 64)
			s.mu.Lock()
			c.createTime = time.Duration(ns)
			s.mu.Unlock()
			l = "created"
		}
		select {
		case c.lines <- l:
		default:
		}
		if strings.HasPrefix(l, "error") {
			s.mu.Lock()
			c.fatal = l
			s.mu.Unlock()
		}
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	c.lastOutputs = append(c.lastOutputs, l)
	if len(c.lastOutputs) > 8 {
		c.lastOutputs = c.lastOutputs[1:]
	}
	f := strings.Fields(l)
	if len(f) == 0 {
		return
	}
	val := func(key string) int64 {
		for _, x := range f[1:] {
			if v, ok := strings.CutPrefix(x, key+"="); ok {
				n, _ := strconv.ParseInt(v, 10, 64)
				return n
			}
		}
		return -1
	}
	switch f[0] {
	case "attached":
		c.attaches++
		c.lastMove = time.Now()
	case "progress", "detached", "closed":
		if n := val("n"); n >= 0 && uint64(n) > c.n {
			c.n = uint64(n)
			c.lastMove = time.Now()
		}
		if n := val("dev"); n >= 0 && uint64(n) > c.devN {
			c.devN = uint64(n)
		}
		if n := val("reads"); n >= 0 && uint64(n) > c.reads {
			c.reads = uint64(n)
		}
		if f[0] != "progress" {
			c.finalLine = l
		}
	case "gone":
		s.pending = append(s.pending, goneReport{c: c, inc: val("inc"), lastSeq: val("last_seq")})
		c.gones++
		c.goneMono = time.Duration(val("mono"))
		c.drainedMono = time.Duration(val("drained"))
	case "MISMATCH", "error":
		if c.fatal == "" {
			c.fatal = l
		}
	}
}

// cProducerTurn tells whether incarnation inc is the C producer's.
func (s *soak) cProducerTurn(inc int64) bool {
	return s.cfg.producer == "c" || (s.cfg.producer == "mixed" && inc%2 == 0)
}

func (s *soak) startProducer() error {
	c := &child{kind: "producer"}
	args := []string{"--name", s.cfg.name, "--slots", strconv.Itoa(int(s.cfg.slots)),
		"--rate", strconv.Itoa(s.cfg.rate), "--inc", strconv.FormatInt(s.inc, 10)}
	var err error
	if s.cProducerTurn(s.inc) {
		if s.cfg.device {
			args = append(args, "--cuda-device", "0")
		}
		if s.cfg.fork {
			args = append(args, "--fork-every", strconv.FormatInt(s.cfg.forkEvery.Milliseconds(), 10),
				"--fork-life", strconv.FormatInt(s.cfg.forkLife.Milliseconds(), 10))
		}
		err = s.start(c, s.cProd, args...)
		s.res.CProducers++
	} else {
		if s.cfg.device {
			args = append(args, "--device", "cuda:0")
		}
		err = s.start(c, s.self, append([]string{"producer"}, args...)...)
		s.res.GoProducers++
	}
	if err != nil {
		return err
	}
	s.prod = c
	s.prodPids = append(s.prodPids, c.pid())
	s.mu.Lock()
	s.producers = append(s.producers, c)
	s.mu.Unlock()
	if l, err := s.producerReply(c, 30*time.Second); err != nil || l != "created" {
		return fmt.Errorf("producer incarnation %d: %q %v", s.inc, l, err)
	}
	seg, err := ring.OpenSegment(s.cfg.name)
	if err != nil {
		return fmt.Errorf("inspect the channel: %w", err)
	}
	if pid := seg.Info().ProducerPid; int(pid) != c.pid() {
		seg.Close()
		return fmt.Errorf("the channel names producer pid %d, started %d", pid, c.pid())
	}
	s.seg = seg
	return nil
}

// producerReply waits for the producer's next output line.
func (s *soak) producerReply(c *child, timeout time.Duration) (string, error) {
	select {
	case l := <-c.lines:
		return l, nil
	case <-c.done:
		// drain what it printed before exiting
		select {
		case l := <-c.lines:
			return l, nil
		default:
		}
		return "", fmt.Errorf("producer exited (%v)", c.cmd.ProcessState)
	case <-time.After(timeout):
		return "", fmt.Errorf("no answer from the producer in %v", timeout)
	}
}

func (s *soak) startReader(slot int) error {
	c := &child{kind: "go", slot: slot}
	if slot < s.cfg.cReaders {
		c.kind = "c"
	} else if slot < s.cfg.cReaders+s.cfg.pyReaders {
		c.kind = "python"
	}
	// Every fourth reader is slow: it holds each batch, so the ring fills
	// and the producer is back-pressured by live readers too.
	if slot%4 == 3 {
		c.slowUs = 300
	}
	var err error
	var forkArg []string
	if s.cfg.fork {
		forkArg = []string{fmt.Sprintf("fork=%d:%d", s.cfg.forkEvery.Milliseconds(), s.cfg.forkLife.Milliseconds())}
	}
	switch c.kind {
	case "c":
		args := []string{s.cfg.name, strconv.Itoa(c.slowUs)}
		if s.cfg.device {
			args = append(args, "device")
		}
		err = s.start(c, s.cReader, append(args, forkArg...)...)
	case "python":
		script := filepath.Join(s.repoRoot(), "tests", "soak", "pyreader", "soak_reader.py")
		err = s.start(c, s.python, append([]string{script, s.cfg.name, strconv.Itoa(c.slowUs)}, forkArg...)...)
	default:
		err = s.start(c, s.self, "reader", s.cfg.name, strconv.Itoa(c.slowUs))
	}
	if err != nil {
		return err
	}
	s.mu.Lock()
	s.readers[slot] = c
	s.history = append(s.history, c)
	c.lastMove = time.Now()
	s.mu.Unlock()
	return nil
}

// checkChildren reports a child that failed or ended on its own.
func (s *soak) checkChildren() error {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range append([]*child{s.prod}, s.readers...) {
		if c == nil {
			continue
		}
		if c.fatal != "" {
			return fmt.Errorf("%s pid %d: %s", c.label(), c.pid(), c.fatal)
		}
		if !c.killed && c.exited() {
			return fmt.Errorf("%s pid %d exited on its own (%v); last output %q", c.label(), c.pid(),
				c.cmd.ProcessState, c.lastOutputs)
		}
	}
	return nil
}

func (c *child) label() string {
	if c.kind == "producer" {
		return "producer"
	}
	return fmt.Sprintf("%s reader %d", c.kind, c.slot)
}

// validateGone checks "producer gone" reports against what each dead
// incarnation published: a surviving reader read all of it.
func (s *soak) validateGone() {
	s.mu.Lock()
	defer s.mu.Unlock()
	keep := s.pending[:0]
	for _, g := range s.pending {
		if g.inc < 0 || g.lastSeq < 0 {
			continue // attached just before the death, read nothing
		}
		final, ok := s.finals[g.inc]
		if !ok {
			if g.inc >= s.inc { // the live incarnation: not dead
				s.failures = append(s.failures, fmt.Sprintf("%s reported producer %d gone, but it lives",
					g.c.label(), g.inc))
				continue
			}
			keep = append(keep, g)
			continue
		}
		if uint64(g.lastSeq)+1 != final {
			s.failures = append(s.failures, fmt.Sprintf(
				"%s: producer incarnation %d published %d batches, the reader's last was seq %d",
				g.c.label(), g.inc, final, g.lastSeq))
			continue
		}
		s.res.GoneChecks++
	}
	s.pending = keep
}

func (s *soak) chaos() {
	cfg := s.cfg
	end := time.Now().Add(cfg.duration)
	jitter := func(d time.Duration) time.Duration {
		return d/2 + time.Duration(s.rnd.Int64N(int64(d)+1))
	}
	nextProducer := time.Time{}
	if cfg.producerEvery > 0 {
		nextProducer = time.Now().Add(jitter(cfg.producerEvery))
	}
	nextStatus := time.Now().Add(cfg.statusEvery)
	for time.Now().Before(end) && !s.failed() {
		time.Sleep(jitter(cfg.chaosEvery))
		now := time.Now()
		for _, c := range s.readers {
			if c.stopped && now.After(c.stopUntil) {
				s.cont(c)
			}
		}
		s.validateGone()
		s.reapForks()
		if err := s.checkChildren(); err != nil {
			s.fail("%v", err)
			break
		}
		s.checkStuck(stuckAfter)
		if now.After(nextStatus) {
			nextStatus = now.Add(cfg.statusEvery)
			s.status()
		}
		if !nextProducer.IsZero() && now.After(nextProducer) {
			nextProducer = now.Add(jitter(cfg.producerEvery))
			if err := s.restartProducer(); err != nil {
				s.fail("restart producer: %v", err)
				break
			}
			continue
		}
		slot := s.rnd.IntN(len(s.readers))
		c := s.readers[slot]
		switch x := s.rnd.Float64(); {
		case x < 0.4:
			s.killReader(c)
		case x < 0.75:
			if !c.stopped && s.stoppedCount() < 2 {
				if syscall.Kill(c.pid(), syscall.SIGSTOP) == nil {
					c.stopped, c.stopUntil = true, now.Add(time.Duration(s.rnd.Int64N(int64(cfg.stopMax)))+10*time.Millisecond)
					s.res.Stops++
					s.kindOf(c).Stops++
				}
			}
		default:
			s.gatingKill(c)
		}
	}
}

func (s *soak) stoppedCount() int {
	n := 0
	for _, c := range s.readers {
		if c.stopped {
			n++
		}
	}
	return n
}

func (s *soak) cont(c *child) {
	syscall.Kill(c.pid(), syscall.SIGCONT)
	c.stopped = false
	s.mu.Lock()
	c.lastMove = time.Now()
	s.mu.Unlock()
}

// stuckAfter is how long a running reader may go without verifying a
// batch (a reader just restarted on a loaded machine: a Python one imports
// numpy first).
const stuckAfter = 15 * time.Second

// checkStuck fails when a running reader has not verified a batch for d.
func (s *soak) checkStuck(d time.Duration) {
	s.mu.Lock()
	defer s.mu.Unlock()
	for _, c := range s.readers {
		if !c.stopped && time.Since(c.lastMove) > d {
			s.failures = append(s.failures, fmt.Sprintf("%s pid %d verified nothing for %v (last output %q)",
				c.label(), c.pid(), d, c.lastOutputs))
		}
	}
}

func (s *soak) status() {
	s.mu.Lock()
	var verified uint64
	for _, c := range s.history {
		verified += c.n
	}
	r := s.res
	followed := len(s.forks)
	s.mu.Unlock()
	fmt.Fprintf(s.log, "soak %v: published %d (incarnation %d), verified %d, kills %d (gating %d), stops %d, producer restarts %d, forked children followed %d\n",
		time.Since(s.stopwatch).Round(time.Second), r.Published+s.seg.Published(), s.inc, verified, r.Kills,
		r.GatingKills, r.Stops, r.ProducerRestarts, followed)
}

// replaceKilled waits until the SIGKILLed reader c is reaped, counts the
// kill and starts a new reader in its slot.
func (s *soak) replaceKilled(c *child) {
	select {
	case <-c.done:
	case <-time.After(10 * time.Second):
		s.fail("%s pid %d not reaped 10 s after SIGKILL", c.label(), c.pid())
		return
	}
	s.res.Kills++
	s.kindOf(c).Kills++
	if err := s.startReader(c.slot); err != nil {
		s.fail("restart %s: %v", c.label(), err)
		return
	}
	s.res.Restarts++
}

// killReader SIGKILLs c and starts a new reader in its slot.
func (s *soak) killReader(c *child) {
	c.killed = true
	syscall.Kill(c.pid(), syscall.SIGKILL)
	s.replaceKilled(c)
}

// recordOf is the index of the live record of pid, or -1.
func (s *soak) recordOf(pid int) int {
	for i := uint32(0); i < s.seg.Readers; i++ {
		snap := s.seg.Snapshot(i)
		if int(snap.Pid) == pid && ring.ClaimState(snap.Claim) == ring.ReaderActive {
			if locked, _ := s.seg.ReaderLocked(i); locked {
				return int(i)
			}
		}
	}
	return -1
}

// gatingKill stops c until the producer waits for it alone, kills it and
// measures how long the producer takes to publish again.
func (s *soak) gatingKill(c *child) {
	for _, o := range s.readers {
		if o != c && o.stopped {
			s.cont(o)
		}
	}
	if !c.stopped {
		syscall.Kill(c.pid(), syscall.SIGSTOP)
		c.stopped = true
	}
	rec := s.recordOf(c.pid())
	gating := false
	var before uint64
	for deadline := time.Now().Add(2 * time.Second); rec >= 0 && time.Now().Before(deadline); {
		before = s.seg.Published()
		cur := s.seg.Cursor(uint32(rec))
		alone := true
		for i := uint32(0); i < s.seg.Readers && alone; i++ {
			if int(i) == rec {
				continue
			}
			snap := s.seg.Snapshot(i)
			if st := ring.ClaimState(snap.Claim); st == ring.ReaderActive {
				if locked, _ := s.seg.ReaderLocked(i); locked && snap.Cursor <= cur {
					alone = false
				}
			}
		}
		if alone && s.seg.ProducerWaiting() && before >= cur+uint64(s.cfg.slots) && s.seg.Published() == before {
			gating = true
			break
		}
		time.Sleep(time.Millisecond)
	}
	kids := s.liveForks(c)
	killedAt := time.Now()
	c.killed = true
	syscall.Kill(c.pid(), syscall.SIGKILL)
	if gating {
		// Measured from the reader's death (seen reaped), not from the
		// signal: on a loaded machine the victim may wait long for a CPU to
		// run its exit, which is no delay of the producer's.
		var deadAt time.Time
		for s.seg.Published() == before {
			if deadAt.IsZero() && c.exited() {
				deadAt = time.Now()
			}
			if time.Since(killedAt) > 10*time.Second {
				break
			}
			time.Sleep(100 * time.Microsecond)
		}
		publishedAt := time.Now()
		if deadAt.IsZero() {
			deadAt = publishedAt // published before the soak saw the reader reaped
		}
		lat := publishedAt.Sub(deadAt)
		// The reader's forked children held its mapping all along: the
		// producer must not have waited for them.
		withChild := len(kids) > 0 && anyAlive(kids)
		s.mu.Lock()
		s.latencies = append(s.latencies, lat)
		if withChild {
			s.childLat = append(s.childLat, lat)
		}
		s.mu.Unlock()
		s.res.GatingKills++
		if withChild {
			s.res.GatingKillsChild++
		}
		if lat > s.cfg.livenessBound {
			s.fail("the producer published again %v after the death of the reader it waited for (bound %v; %d forked children of it alive at the kill)",
				lat.Round(time.Millisecond), s.cfg.livenessBound, len(kids))
		}
	}
	s.replaceKilled(c)
}

// restartProducer SIGKILLs the producer, records what it published, checks
// that every reader attached to it reports "producer gone" within
// --gone-bound, and starts the next incarnation, which must take the name
// at its first Create. The dead producer's forked children, alive, must
// change none of it.
func (s *soak) restartProducer() error {
	old := s.prod
	// Every reader can report in time: none is stopped. Those attached now
	// (their "attached" line is in, their "gone" not yet) must report.
	for _, c := range s.readers {
		if c.stopped {
			s.cont(c)
		}
	}
	attached := map[*child]int{} // reader -> its "gone" lines before the kill
	s.mu.Lock()
	for _, c := range s.readers {
		if c.attaches > c.gones {
			attached[c] = c.gones
		}
	}
	s.mu.Unlock()
	kids := s.liveForks(old)
	killedAt := monoNow()
	old.killed = true
	syscall.Kill(old.pid(), syscall.SIGKILL)
	select {
	case <-old.done:
	case <-time.After(10 * time.Second):
		return fmt.Errorf("producer pid %d not reaped 10 s after SIGKILL", old.pid())
	}
	final := s.seg.Published()
	s.seg.Close()
	s.mu.Lock()
	s.finals[s.inc] = final
	s.res.Published += final
	s.inc++
	s.mu.Unlock()
	s.checkGone(attached, killedAt, len(kids))
	if err := s.startProducer(); err != nil {
		return fmt.Errorf("%w (the dead producer had %d forked children alive)", err, len(kids))
	}
	s.mu.Lock()
	s.createMax = max(s.createMax, s.prod.createTime)
	s.mu.Unlock()
	// The children lived until the name was taken: they held the dead
	// producer's mapping through all of the above.
	if len(kids) > 0 && anyAlive(kids) {
		s.res.ProducerKillsChild++
	}
	s.res.ProducerRestarts++
	return nil
}

// checkGone waits for each reader attached at the producer's death
// (killedAt, CLOCK_MONOTONIC) to report "producer gone", and checks when
// it got it: within --gone-bound of the moment it had nothing left to read
// (the kill, or its last batch if it was behind: reading a backlog is not
// the death's cost), not EAGAIN for longer.
func (s *soak) checkGone(attached map[*child]int, killedAt time.Duration, kids int) {
	wait := max(stuckAfter, 2*s.cfg.goneBound) // for the report: the bound is checked on its stamps
	deadline := time.Now().Add(wait)
	for {
		s.mu.Lock()
		for c, before := range attached {
			if c.gones == before {
				if c.exited() {
					delete(attached, c) // died on its own: checkChildren reports it
				}
				continue
			}
			delete(attached, c)
			lat := c.goneMono - max(killedAt, c.drainedMono)
			switch {
			case c.goneMono < killedAt:
				s.failures = append(s.failures, fmt.Sprintf("%s reported producer gone %v before the producer was killed",
					c.label(), killedAt-c.goneMono))
			case lat > s.cfg.goneBound:
				s.failures = append(s.failures, fmt.Sprintf(
					"%s got \"producer gone\" %v after the producer's death and its last batch (%v after the death; bound %v; %d forked children of the producer alive)",
					c.label(), lat.Round(time.Millisecond), (c.goneMono-killedAt).Round(time.Millisecond),
					s.cfg.goneBound, kids))
			}
			s.goneLat = append(s.goneLat, lat)
			s.goneRawMax = max(s.goneRawMax, c.goneMono-killedAt)
		}
		s.mu.Unlock()
		if len(attached) == 0 {
			return
		}
		if time.Now().After(deadline) {
			for c := range attached {
				s.fail("%s did not report \"producer gone\" within %v of the producer's death (%d forked children of the producer alive)",
					c.label(), wait, kids)
			}
			return
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// finish ends the run and checks for leaks.
func (s *soak) finish() {
	if s.prod == nil || s.seg == nil {
		return
	}
	for _, c := range s.readers {
		if c != nil && c.stopped {
			s.cont(c)
		}
	}
	if !s.failed() {
		// Everyone still reads: each reader verifies batches within
		// stuckAfter.
		before := map[*child]uint64{}
		s.mu.Lock()
		for _, c := range s.readers {
			before[c] = c.n
		}
		s.mu.Unlock()
		deadline := time.Now().Add(stuckAfter)
		for {
			moved := 0
			s.mu.Lock()
			for _, c := range s.readers {
				if c.n > before[c] {
					moved++
				}
			}
			s.mu.Unlock()
			if moved == len(s.readers) {
				break
			}
			if time.Now().After(deadline) {
				s.fail("at the end only %d of %d readers were still reading", moved, len(s.readers))
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
	}
	s.validateGone()
	// The producer stops publishing; half the readers detach, half die.
	fmt.Fprintln(s.prod.stdin, "pause")
	if l, err := s.producerReply(s.prod, 30*time.Second); err != nil || l != "paused" {
		s.fail("pause the producer: %q %v", l, err)
		return
	}
	for _, c := range s.readers {
		if c.slot%2 == 0 {
			c.killed = true
			syscall.Kill(c.pid(), syscall.SIGTERM)
		} else {
			s.killReaderForGood(c)
		}
	}
	for _, c := range s.readers {
		select {
		case <-c.done:
		case <-time.After(20 * time.Second):
			s.fail("%s pid %d did not exit after SIGTERM", c.label(), c.pid())
			syscall.Kill(c.pid(), syscall.SIGKILL)
			<-c.done
		}
		if c.slot%2 == 0 {
			s.mu.Lock()
			if code := c.cmd.ProcessState.ExitCode(); code != 0 || !strings.HasPrefix(c.finalLine, "detached") {
				s.failures = append(s.failures, fmt.Sprintf("%s did not detach cleanly on SIGTERM: exit %d, %q",
					c.label(), code, c.lastOutputs))
			}
			s.mu.Unlock()
		}
	}
	// Two rings' worth of batches: the producer gates on the dead readers'
	// records and reclaims them.
	fmt.Fprintf(s.prod.stdin, "drain %d\n", 2*s.cfg.slots)
	if l, err := s.producerReply(s.prod, 60*time.Second); err != nil || l != "drained ok" {
		s.fail("publish after the readers left: %q %v", l, err)
	}
	// No leaked record or lock, with the forked children of the readers
	// (and producers) that just died still holding their mappings.
	s.res.ChildrenAtEnd = s.liveForksCount()
	for i := uint32(0); i < s.seg.Readers; i++ {
		snap := s.seg.Snapshot(i)
		locked, err := s.seg.ReaderLocked(i)
		if err != nil || locked || ring.ClaimState(snap.Claim) != ring.ReaderFree {
			s.fail("reader record %d left %s (locked %v, pid %d)", i, ring.StateName(ring.ClaimState(snap.Claim)),
				locked, snap.Pid)
		}
		s.res.RecordsChecked++
	}
	final := s.seg.Published()
	s.mu.Lock()
	s.res.Published += final
	var devN, reads uint64
	for _, c := range s.history {
		devN, reads = devN+c.devN, reads+c.reads
	}
	s.mu.Unlock()
	if s.cfg.device && devN == 0 {
		s.fail("--device: no C reader verified a device copy")
	}
	if s.cfg.device && s.cfg.libcuda == "" && reads == 0 {
		s.fail("--device: no GPU read queued before a release was verified")
	}
	fmt.Fprintln(s.prod.stdin, "close")
	if l, err := s.producerReply(s.prod, 30*time.Second); err != nil || l != "closed" {
		s.fail("close the producer: %q %v", l, err)
	}
	select {
	case <-s.prod.done:
		if code := s.prod.cmd.ProcessState.ExitCode(); code != 0 {
			s.fail("producer exited %d after close", code)
		}
	case <-time.After(20 * time.Second):
		s.fail("producer did not exit after close")
	}
	s.prod.killed = true
	s.seg.Close()
	s.seg = nil
	// No file left in /dev/shm.
	if _, err := os.Lstat(ring.ChannelPath(s.cfg.name)); !errors.Is(err, os.ErrNotExist) {
		s.fail("%s left behind (%v)", ring.ChannelPath(s.cfg.name), err)
	}
	ents, _ := os.ReadDir(ring.ShmDir)
	for _, e := range ents {
		for _, pid := range s.prodPids {
			if strings.HasPrefix(e.Name(), fmt.Sprintf(".tsock-tmp.%d.", pid)) {
				s.fail("temporary file %s/%s left behind", ring.ShmDir, e.Name())
			}
		}
	}
}

func (s *soak) killReaderForGood(c *child) {
	c.killed = true
	syscall.Kill(c.pid(), syscall.SIGKILL)
}

// cleanup kills whatever still runs and removes the channel on failure.
func (s *soak) cleanup() {
	for _, c := range append([]*child{s.prod}, s.readers...) {
		if c != nil && c.cmd != nil && !c.exited() {
			c.killed = true
			c.cmd.Process.Kill()
			<-c.done
		}
	}
	own := map[int]bool{}
	for _, pid := range s.prodPids {
		own[pid] = true
	}
	for _, c := range s.history {
		own[c.pid()] = true
	}
	s.killForks(own)
	if s.seg != nil {
		s.seg.Close()
	}
	if s.failed() {
		if seg, err := ring.OpenSegment(s.cfg.name); err == nil {
			pid := seg.Info().ProducerPid
			seg.Close()
			for _, p := range s.prodPids {
				if int(pid) == p {
					os.Remove(ring.ChannelPath(s.cfg.name))
				}
			}
		}
	}
	if s.tmpDir != "" {
		os.RemoveAll(s.tmpDir)
	}
}

func printResult(w io.Writer, cfg config, r Result) {
	fmt.Fprintf(w, "tsock soak: %.0f s, %d readers (%d C, %d Python, %d Go), %d slots, producer at %d batches/s, seed %d\n",
		r.Seconds, r.Readers, r.CReaders, r.PyReaders, r.GoReaders, cfg.slots, cfg.rate, r.Seed)
	if r.PyFallback != "" {
		fmt.Fprintf(w, "  no Python readers: %s\n", r.PyFallback)
	}
	fmt.Fprintf(w, "  reader kills (SIGKILL)      %d (%d while the producer waited for that reader alone)\n", r.Kills, r.GatingKills)
	fmt.Fprintf(w, "  reader restarts             %d\n", r.Restarts)
	fmt.Fprintf(w, "  reader stops (SIGSTOP/CONT) %d\n", r.Stops)
	fmt.Fprintf(w, "  producer kills and restarts %d (readers re-attached %d times)\n", r.ProducerRestarts, r.Reattaches)
	fmt.Fprintf(w, "  batches published           %d\n", r.Published)
	fmt.Fprintf(w, "  batches verified            %d (content, checksum and order, by every reader)\n", r.Verified)
	if r.Device != "" {
		fmt.Fprintf(w, "  device copies verified      %d (C readers: device copy = host copy), %d queued GPU reads saw their batch (driver %s)\n",
			r.DeviceVerified, r.DeviceReads, r.Device)
	}
	fmt.Fprintf(w, "  producer-gone checks        %d (a surviving reader read all the dead producer published)\n", r.GoneChecks)
	if r.GatingKills > 0 {
		fmt.Fprintf(w, "  reader death -> next publish p50 %.1f ms, p99 %.1f ms, max %.1f ms (bound %v)\n",
			r.LatencyP50Ms, r.LatencyP99Ms, r.LatencyMaxMs, cfg.livenessBound)
	}
	fmt.Fprintf(w, "  producers                   %d C (libtsock.so), %d Go incarnations\n", r.CProducers, r.GoProducers)
	if r.Forking {
		fmt.Fprintf(w, "  forked children (no exec)   %d by C producers, %d by C and Python readers; each lives %v\n",
			r.ProducerForks, r.ReaderForks, cfg.forkLife)
		fmt.Fprintf(w, "    gating kills, reader's child alive    %d (max death -> next publish %.1f ms)\n",
			r.GatingKillsChild, r.ChildLatencyMaxMs)
		fmt.Fprintf(w, "    producer kills, producer's child alive %d of %d\n", r.ProducerKillsChild, r.ProducerRestarts)
		fmt.Fprintf(w, "    alive at the end-of-run record check  %d\n", r.ChildrenAtEnd)
	} else {
		fmt.Fprintln(w, "  forked children             none (--fork=false)")
	}
	if r.GoneTimed > 0 {
		fmt.Fprintf(w, "  producer kill -> \"gone\"     p50 %.1f ms, p99 %.1f ms, max %.1f ms over %d readers (bound %v; from the kill or the reader's last batch; max %.1f ms with the backlog read)\n",
			r.GoneP50Ms, r.GoneP99Ms, r.GoneMaxMs, r.GoneTimed, cfg.goneBound, r.GoneRawMaxMs)
	}
	if r.ProducerRestarts > 0 {
		fmt.Fprintf(w, "  new producer's Create       every one at its first try, longest %.1f ms\n", r.CreateMaxMs)
	}
	for _, kind := range []string{"c", "python", "go"} {
		if k := r.Kinds[kind]; k != nil {
			fmt.Fprintf(w, "  %-6s readers %d: %d processes, %d kills, %d stops, %d re-attaches, %d forks, %d batches verified\n",
				kind, k.Slots, k.Processes, k.Kills, k.Stops, k.Reattaches, k.Forks, k.Verified)
		}
	}
	fmt.Fprintf(w, "  reader records at the end   %d checked: free and unlocked\n", r.RecordsChecked)
	if r.OK {
		fmt.Fprintln(w, "OK: no batch missed or repeated, no stall beyond the bound, nothing leaked")
		return
	}
	fmt.Fprintf(w, "FAILED (%d):\n", len(r.Failures))
	for _, f := range r.Failures {
		fmt.Fprintf(w, "  %s\n", f)
	}
}

package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"runtime"
	"strconv"
	"strings"
	"sync/atomic"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/tsock/tsock/internal/childproc"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

func init() {
	register(&command{
		name:    "demo",
		summary: "run a producer and N reader processes, verify every batch, report rates",
		help: `Starts one producer in this process and --readers reader processes (this
binary re-executed as 'tsock demo-reader'). The producer waits for every
reader to attach, then publishes --epochs epochs of --batches batches. Each
batch holds a float32 feature tensor and an int64 label tensor filled from a
PRNG; its metadata carries their CRC-32C, which every reader recomputes.
The table shows each reader's throughput and checksum result and the
producer's rate. The exit status is 1 if any reader failed.`,
		run:   runDemo,
		flags: func() *flag.FlagSet { c := defaultDemoConfig(); return c.flagSet(io.Discard, false) },
	})
}

// demoConfig is the demo's command line.
type demoConfig struct {
	readers    int
	batches    int // per epoch
	batchBytes uint64
	slots      uint
	epochs     int
	name       string
	spin       time.Duration // readers' busy-poll before sleeping
	timeout    time.Duration // longest wait for any single step
	jsonOut    bool
	corruptAt  int // test hook: publish a wrong checksum for this batch (1-based); 0 never
}

// defaultDemoConfig holds the documented defaults.
func defaultDemoConfig() demoConfig {
	return demoConfig{readers: 4, batches: 20000, batchBytes: 65536, slots: 16, epochs: 2,
		spin: 20 * time.Microsecond, timeout: 30 * time.Second}
}

// flagSet binds the demo's flags to c. withHidden adds the test hooks.
func (c *demoConfig) flagSet(w io.Writer, withHidden bool) *flag.FlagSet {
	fs := newFlagSet("demo", w)
	fs.IntVar(&c.readers, "readers", c.readers, "reader processes to start")
	fs.IntVar(&c.batches, "batches", c.batches, "batches per epoch")
	fs.Uint64Var(&c.batchBytes, "batch-bytes", c.batchBytes, "payload bytes per batch (features + labels)")
	fs.UintVar(&c.slots, "slots", c.slots, "ring depth, a power of two")
	fs.IntVar(&c.epochs, "epochs", c.epochs, "epochs to publish")
	fs.StringVar(&c.name, "name", c.name, "channel name (default tsock-demo-<pid>)")
	fs.DurationVar(&c.spin, "spin", c.spin, "readers busy-poll this long before sleeping (negative: never)")
	fs.DurationVar(&c.timeout, "timeout", c.timeout, "give up when one step (attach, publish, read) waits this long")
	fs.BoolVar(&c.jsonOut, "json", c.jsonOut, "print the result as JSON instead of a table")
	if withHidden {
		fs.IntVar(&c.corruptAt, "corrupt-batch", 0, "test hook: publish a wrong checksum for batch N (1-based)")
	}
	return fs
}

// check validates c and fills the default name.
func (c *demoConfig) check() error {
	switch {
	case c.readers < 1 || c.readers > int(ring.MaxReaders):
		return fmt.Errorf("--readers must be in 1..%d", ring.MaxReaders)
	case c.batches < 1:
		return fmt.Errorf("--batches must be at least 1")
	case c.epochs < 1:
		return fmt.Errorf("--epochs must be at least 1")
	case c.timeout <= 0:
		return fmt.Errorf("--timeout must be positive")
	}
	if c.name == "" {
		c.name = fmt.Sprintf("tsock-demo-%d", os.Getpid())
	}
	if !ring.NameOK(c.name) {
		return fmt.Errorf("--name %q is not 1..%d of [A-Za-z0-9._-]", c.name, ring.NameMax)
	}
	return nil
}

// demoResult is the outcome of a demo run (also its --json output).
type demoResult struct {
	Channel    string         `json:"channel"`
	Slots      uint32         `json:"slots"`
	BatchBytes uint64         `json:"batch_bytes"` // bytes of tensors per batch
	Layout     string         `json:"layout"`
	Epochs     int            `json:"epochs"`
	Batches    int            `json:"batches_per_epoch"`
	Producer   producerResult `json:"producer"`
	Readers    []readerResult `json:"readers"`
	OK         bool           `json:"ok"`
	Error      string         `json:"error,omitempty"`
}

// producerResult is the producer's side of a demo run.
type producerResult struct {
	Pid           int     `json:"pid"`
	Batches       uint64  `json:"batches"` // data batches, epoch markers excluded
	Epochs        int     `json:"epochs"`  // epochs ended
	Bytes         uint64  `json:"bytes"`
	Seconds       float64 `json:"seconds"`
	Backpressure  float64 `json:"backpressure_seconds"`
	Reclaimed     uint64  `json:"readers_reclaimed"`
	MBPerSec      float64 `json:"mb_per_s"`
	BatchesPerSec float64 `json:"batches_per_s"`
}

// readerResult is one reader process's report plus what the parent saw.
type readerResult struct {
	demoReport
	MBPerSec      float64 `json:"mb_per_s"`
	BatchesPerSec float64 `json:"batches_per_s"`
	Exit          string  `json:"exit"` // the process's exit status
	OK            bool    `json:"ok"`
	Problem       string  `json:"problem,omitempty"` // why it failed, if it did
}

// runDemo is the entry point of `tsock demo`.
func runDemo(e *env, args []string) int {
	cfg := defaultDemoConfig()
	fs := cfg.flagSet(e.stderr, true)
	if st, ok := parseFlags(fs, args); !ok {
		return st
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(e.stderr, "tsock demo: unexpected arguments %q\n", fs.Args())
		return exitUsage
	}
	if err := cfg.check(); err != nil {
		fmt.Fprintf(e.stderr, "tsock demo: %v\n", err)
		return exitUsage
	}

	var stop atomic.Bool
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, os.Interrupt, syscall.SIGTERM)
	defer signal.Stop(sigs)
	go func() {
		if _, ok := <-sigs; ok {
			stop.Store(true)
		}
	}()

	res := runDemoParent(cfg, e.stderr, &stop)
	if cfg.jsonOut {
		enc := json.NewEncoder(e.stdout)
		enc.SetIndent("", "  ")
		_ = enc.Encode(res)
	} else {
		printDemoTable(e.stdout, res)
	}
	if !res.OK {
		return exitFail
	}
	return exitOK
}

// demoChild is one reader process; its stdout is its JSON report.
type demoChild struct {
	*childproc.Process
	stdout bytes.Buffer
}

// runDemoParent runs the producer and the readers and gathers the result;
// it never returns an error, it records it in the result.
func runDemoParent(cfg demoConfig, stderr io.Writer, stop *atomic.Bool) (res demoResult) {
	res = demoResult{Channel: cfg.name, Epochs: cfg.epochs, Batches: cfg.batches}
	fail := func(format string, args ...any) demoResult {
		res.OK = false
		res.Error = fmt.Sprintf(format, args...)
		return res
	}
	layout, err := newDemoLayout(cfg.batchBytes)
	if err != nil {
		return fail("%v", err)
	}
	res.Layout, res.BatchBytes = layout.String(), layout.featBytes+layout.labelBytes
	self, err := os.Executable()
	if err != nil {
		return fail("cannot find this executable to start readers: %v", err)
	}

	p, err := producer.Create(cfg.name, producer.Options{
		Slots:      uint32(cfg.slots),
		SlotBytes:  cfg.batchBytes,
		MaxReaders: uint32(max(cfg.readers, producer.DefaultMaxReaders)),
	})
	if err != nil {
		return fail("create channel %q: %v", cfg.name, err)
	}
	closed := false
	closeProducer := func() {
		if !closed {
			closed = true
			_ = p.Close()
		}
	}
	defer closeProducer()
	res.Slots = p.Slots()

	// Pdeathsig is delivered when the thread that forked the child exits,
	// not the process: keep this goroutine on one thread while children
	// live (Go threads only exit when a locked goroutine ends).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	// Readers share our stderr. exec copies into a writer that is not a
	// file from one goroutine per child: serialise those writes.
	childStderr := stderr
	if _, isFile := stderr.(*os.File); !isFile {
		childStderr = childproc.Serialized(stderr)
	}
	children := make([]*demoChild, 0, cfg.readers)
	defer func() {
		for _, c := range children { // on early failure, do not leave readers behind
			c.Kill()
		}
	}()
	for i := 0; i < cfg.readers; i++ {
		c := &demoChild{}
		args := []string{"demo-reader", cfg.name,
			"--parent", strconv.Itoa(os.Getpid()),
			"--batches", strconv.Itoa(cfg.batches),
			"--epochs", strconv.Itoa(cfg.epochs),
			"--batch-bytes", strconv.FormatUint(cfg.batchBytes, 10),
			"--spin", cfg.spin.String(),
			"--timeout", cfg.timeout.String()}
		p, err := childproc.Start(self, args, childproc.Options{Stdout: &c.stdout, Stderr: childStderr})
		if err != nil {
			return fail("start reader %d: %v", i, err)
		}
		c.Process = p
		children = append(children, c)
	}

	// Wait for every reader to attach; a reader that exits first is fatal.
	deadline := time.Now().Add(cfg.timeout)
	for {
		err := p.WaitReaders(cfg.readers, 20*time.Millisecond)
		if err == nil {
			break
		}
		if !errors.Is(err, producer.ErrTimedOut) {
			return fail("wait for readers: %v", err)
		}
		for _, c := range children {
			if c.Exited() {
				return fail("reader pid %d exited before attaching (%v): %s",
					c.Pid(), exitText(c.Err()), strings.TrimSpace(c.stdout.String()))
			}
		}
		if stop.Load() {
			return fail("interrupted")
		}
		if time.Now().After(deadline) {
			return fail("only %d of %d readers attached within %v", len(p.Readers()), cfg.readers, cfg.timeout)
		}
	}

	// Publish.
	tensors := layout.tensors()
	start := ring.MonotonicNs()
	var n uint64
	var pubErr error
	epochs := 0
publish:
	for ep := 0; ep < cfg.epochs; ep++ {
		for i := 0; i < cfg.batches; i++ {
			if stop.Load() {
				pubErr = errors.New("interrupted")
				break publish
			}
			buf, err := p.Reserve(layout.total, cfg.timeout)
			if err != nil {
				pubErr = fmt.Errorf("reserve batch %d of epoch %d: %w", i, ep, err)
				break publish
			}
			meta := layout.fill(buf, uint64(ep), uint64(i))
			n++
			if int(n) == cfg.corruptAt {
				meta[32] ^= 0xff // the feature CRC
			}
			if err := p.Publish(tensors, meta); err != nil {
				pubErr = fmt.Errorf("publish batch %d of epoch %d: %w", i, ep, err)
				break publish
			}
		}
		if err := p.EndEpoch(cfg.timeout); err != nil {
			pubErr = fmt.Errorf("end epoch %d: %w", ep, err)
			break
		}
		epochs++
	}
	elapsed := float64(ring.MonotonicNs()-start) / 1e9
	st := p.Stats()
	closeProducer() // readers drain what was published, then see "closed"

	pr := producerResult{Pid: os.Getpid(), Batches: n, Epochs: epochs, Bytes: n * res.BatchBytes, Seconds: elapsed,
		Backpressure: float64(st.BackpressureNs) / 1e9, Reclaimed: st.ReadersReclaimed}
	if elapsed > 0 {
		pr.MBPerSec = float64(pr.Bytes) / 1e6 / elapsed
		pr.BatchesPerSec = float64(n) / elapsed
	}
	res.Producer = pr

	// Collect the readers' reports.
	want := uint64(cfg.batches) * uint64(cfg.epochs)
	waitUntil := time.Now().Add(cfg.timeout)
	res.OK = pubErr == nil
	for _, c := range children {
		_ = c.Wait(max(time.Until(waitUntil), 0)) // judgeReader says how it ended
		rr := judgeReader(c, want, uint64(cfg.epochs))
		res.OK = res.OK && rr.OK
		res.Readers = append(res.Readers, rr)
	}
	if pubErr != nil {
		res.Error = pubErr.Error()
	}
	return res
}

// judgeReader parses a finished child's report and decides whether it
// passed: clean exit, every batch in order, every checksum right.
func judgeReader(c *demoChild, wantBatches, wantEpochs uint64) readerResult {
	rr := readerResult{Exit: exitText(c.Err())}
	rr.Pid = c.Pid()
	line := lastLine(c.stdout.String())
	if err := json.Unmarshal([]byte(line), &rr.demoReport); err != nil {
		rr.Problem = fmt.Sprintf("no report (%s)", rr.Exit)
		return rr
	}
	rr.Pid = c.Pid()
	if rr.Seconds > 0 {
		rr.MBPerSec = float64(rr.Bytes) / 1e6 / rr.Seconds
		rr.BatchesPerSec = float64(rr.Batches) / rr.Seconds
	}
	switch {
	case rr.Error != "":
		rr.Problem = rr.Error
	case rr.ChecksumBad > 0:
		rr.Problem = fmt.Sprintf("%d bad batches, first: %s", rr.ChecksumBad, rr.FirstBad)
	case rr.OrderErrors > 0:
		rr.Problem = fmt.Sprintf("%d batches out of order", rr.OrderErrors)
	case c.Err() != nil:
		rr.Problem = rr.Exit
	case rr.Batches != wantBatches || rr.Epochs != wantEpochs:
		rr.Problem = fmt.Sprintf("read %d batches in %d epochs, want %d in %d", rr.Batches, rr.Epochs, wantBatches, wantEpochs)
	default:
		rr.OK = true
	}
	return rr
}

// exitText describes the result of exec.Cmd.Wait.
func exitText(err error) string {
	if err == nil {
		return "exit 0"
	}
	return err.Error()
}

// lastLine is the last non-empty line of s.
func lastLine(s string) string {
	s = strings.TrimRight(s, "\n")
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	return s
}

// printDemoTable writes the human-readable result.
func printDemoTable(w io.Writer, r demoResult) {
	fmt.Fprintf(w, "tsock demo: channel %s, %d slots, %d epochs x %d batches of %s (%d bytes)\n\n",
		r.Channel, r.Slots, r.Epochs, r.Batches, r.Layout, r.BatchBytes)
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "ROLE\tPID\tBATCHES\tEPOCHS\tSECONDS\tMB/s\tBATCHES/s\tCHECKSUMS\tSTATUS")
	for i, rr := range r.Readers {
		sum := "-"
		if rr.ChecksumOK+rr.ChecksumBad > 0 {
			sum = "OK"
			if rr.ChecksumBad > 0 {
				sum = fmt.Sprintf("%d BAD", rr.ChecksumBad)
			}
		}
		status := "ok"
		if !rr.OK {
			status = "FAILED: " + rr.Problem
		}
		fmt.Fprintf(tw, "reader %d\t%d\t%d\t%d\t%.3f\t%.1f\t%.0f\t%s\t%s\n", i, rr.Pid, rr.Batches, rr.Epochs,
			rr.Seconds, rr.MBPerSec, rr.BatchesPerSec, sum, status)
	}
	pr := r.Producer
	if pr.Pid != 0 {
		fmt.Fprintf(tw, "producer\t%d\t%d\t%d\t%.3f\t%.1f\t%.0f\t-\tback-pressure %.3f s\n", pr.Pid, pr.Batches,
			pr.Epochs, pr.Seconds, pr.MBPerSec, pr.BatchesPerSec, pr.Backpressure)
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	failed := 0
	for _, rr := range r.Readers {
		if !rr.OK {
			failed++
		}
	}
	switch {
	case r.OK:
		var agg float64
		for _, rr := range r.Readers {
			agg += rr.MBPerSec
		}
		fmt.Fprintf(w, "OK: %d readers each verified %d batches; %.1f MB/s read in all\n",
			len(r.Readers), uint64(r.Batches)*uint64(r.Epochs), agg)
	case r.Error != "":
		fmt.Fprintf(w, "FAILED: %s (%d of %d readers failed)\n", r.Error, failed, len(r.Readers))
	default:
		fmt.Fprintf(w, "FAILED: %d of %d readers failed\n", failed, len(r.Readers))
	}
}

package mp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/childproc"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// Environment of helper processes (the test binary re-executed).
const (
	envRole = "TSOCK_MP_ROLE" // "reader" or "producer"
	envArgs = "TSOCK_MP_ARGS" // space-separated arguments of the role
)

var (
	repoRoot = func() string {
		_, file, _, _ := runtime.Caller(0)
		return filepath.Dir(filepath.Dir(filepath.Dir(file)))
	}()

	buildDir     string // temporary directory for check_reader
	checkOnce    sync.Once
	checkReader  string // path of the built check_reader, "" if unavailable
	checkBuildMs time.Duration
	checkErr     error

	nameSeq atomic.Int64
)

func TestMain(m *testing.M) {
	if os.Getenv(envRole) == "" {
		d, err := os.MkdirTemp("", "tsock-mp-")
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		buildDir = d
	}
	code := m.Run()
	if buildDir != "" {
		os.RemoveAll(buildDir)
	}
	os.Exit(code)
}

// channel returns a unique channel name and removes its segment at the end.
func channel(t *testing.T) string {
	t.Helper()
	name := fmt.Sprintf("mp-%d-%d-%d", os.Getpid(), nameSeq.Add(1), time.Now().UnixNano()%1e6)
	require.True(t, ring.NameOK(name))
	t.Cleanup(func() { os.Remove(ring.ChannelPath(name)) })
	return name
}

// needCheckReader builds tests/c/check_reader.c once (with the same C reader
// sources as libtsock_reader.so: every C file of reader/) and returns its path.
func needCheckReader(t *testing.T) string {
	t.Helper()
	checkOnce.Do(func() {
		src := filepath.Join(repoRoot, "tests", "c", "check_reader.c")
		if _, err := os.Stat(src); err != nil {
			checkErr = fmt.Errorf("%s is missing: %w", src, err)
			return
		}
		cc := os.Getenv("CC")
		if cc == "" {
			cc = "cc"
		}
		exe := filepath.Join(buildDir, "check_reader")
		start := time.Now()
		readerSources, _ := filepath.Glob(filepath.Join(repoRoot, "reader", "*.c"))
		args := append([]string{"-O2", "-std=c11", "-Wall", "-Werror",
			"-I" + filepath.Join(repoRoot, "include"), "-I" + filepath.Join(repoRoot, "ring"), src},
			readerSources...)
		out, err := exec.Command(cc, append(args, "-ldl", "-lpthread", "-o", exe)...).CombinedOutput()
		checkBuildMs = time.Since(start)
		if err != nil {
			checkErr = fmt.Errorf("building check_reader: %v\n%s", err, out)
			return
		}
		checkReader = exe
	})
	if errors.Is(checkErr, exec.ErrNotFound) {
		t.Skipf("no C compiler: %v", checkErr)
	}
	require.NoError(t, checkErr)
	return checkReader
}

// proc is a child process whose output is collected.
type proc struct {
	*childproc.Process
	label string
	cmd   *exec.Cmd
	lines chan string // stdout lines as they come (buffered, may drop when full)
	mu    sync.Mutex
	seen  []seenLine // every stdout line and when it arrived, under mu
}

// start runs a child that dies with the test: SIGKILL on the parent's death
// and in the test's cleanup.
func start(t *testing.T, label string, env []string, name string, args ...string) *proc {
	t.Helper()
	return startAttr(t, label, env, &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}, name, args...)
}

// startAttr is start with the child's process attributes (another user:
// testkit.AsUser, which also kills it with the test).
func startAttr(t *testing.T, label string, env []string, attr *syscall.SysProcAttr, name string, args ...string) *proc {
	t.Helper()
	p := &proc{label: label, lines: make(chan string, 1024)}
	o := childproc.Options{Label: label, Env: env, Attr: attr, OnLine: p.onLine}
	if attr.Credential != nil {
		o.Dir = "/" // another user may not enter ours
	}
	c, err := childproc.Start(name, args, o)
	require.NoError(t, err, "starting %s", label)
	p.Process, p.cmd = c, c.Cmd
	t.Cleanup(func() {
		p.Kill()
		if t.Failed() {
			t.Logf("%s output:\n%s", p.label, p.Output())
		}
	})
	return p
}

// onLine records a stdout line of the child.
func (p *proc) onLine(line string) {
	p.mu.Lock()
	p.seen = append(p.seen, seenLine{time.Now(), line})
	p.mu.Unlock()
	select {
	case p.lines <- line:
	default:
	}
}

// seenLine is a stdout line of a child and when the test read it.
type seenLine struct {
	at   time.Time
	line string
}

// lineAt is when the child's first stdout line with the given prefix
// arrived (zero if none did).
func (p *proc) lineAt(prefix string) time.Time {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, l := range p.seen {
		if strings.HasPrefix(l.line, prefix) {
			return l.at
		}
	}
	return time.Time{}
}

// wait waits for the child to end and returns its exit code (-1 when killed
// by a signal).
func (p *proc) wait(t *testing.T, timeout time.Duration) int {
	t.Helper()
	if err := p.Wait(timeout); errors.Is(err, childproc.ErrTimedOut) {
		t.Fatalf("%s still running after %v; output:\n%s", p.label, timeout, p.Output())
	}
	return p.ExitCode()
}

// waitLine waits for a stdout line with the given prefix.
func (p *proc) waitLine(t *testing.T, prefix string, timeout time.Duration) string {
	t.Helper()
	deadline := time.After(timeout)
	for {
		select {
		case l := <-p.lines:
			if strings.HasPrefix(l, prefix) {
				return l
			}
		case <-p.Done():
			// drain what is buffered
			for {
				select {
				case l := <-p.lines:
					if strings.HasPrefix(l, prefix) {
						return l
					}
				default:
					t.Fatalf("%s ended (%v) before printing %q; output:\n%s", p.label, p.Err(), prefix, p.Output())
				}
			}
		case <-deadline:
			t.Fatalf("%s printed no %q in %v; output:\n%s", p.label, prefix, timeout, p.Output())
		}
	}
}

// result parses the child's summary line.
func (p *proc) result(t *testing.T) batchgen.Result {
	t.Helper()
	r, err := batchgen.ParseLine(p.Output())
	require.NoError(t, err, "%s", p.label)
	return r
}

// readerSpec describes a reader child.
type readerSpec struct {
	lang     string // "c" or "go"
	expected uint64 // data batches to read; 0: until the stream ends
	start    string // "next" or "now"
	slowUs   int64  // hold each batch this long
}

func (s readerSpec) args(name string) []string {
	st := s.start
	if st == "" {
		st = "next"
	}
	return []string{name, strconv.FormatUint(s.expected, 10), st, strconv.FormatInt(s.slowUs, 10)}
}

// startReader starts a C (check_reader) or Go (helper) reader child.
func startReader(t *testing.T, name string, s readerSpec, label string) *proc {
	t.Helper()
	if s.lang == "c" {
		return start(t, label, nil, needCheckReader(t), s.args(name)...)
	}
	return start(t, label, []string{envRole + "=reader", envArgs + "=" + strings.Join(s.args(name), " ")},
		os.Args[0], "-test.run=^TestHelperReader$")
}

// TestHelperReader is the Go twin of tests/c/check_reader.c, run as a child
// process: same arguments (NAME EXPECTED_BATCHES [next|now] [slow_us]),
// same output, same exit codes (0 complete or closed, 2 mismatch, 3 producer
// gone, 1 other errors).
func TestHelperReader(t *testing.T) {
	if os.Getenv(envRole) != "reader" {
		t.Skip("helper process")
	}
	os.Exit(helperReader(strings.Fields(os.Getenv(envArgs))))
}

func helperReader(args []string) int {
	if len(args) < 2 {
		fmt.Println("usage: NAME EXPECTED_BATCHES [next|now] [slow_us]")
		return 1
	}
	name := args[0]
	expected, _ := strconv.ParseUint(args[1], 10, 64)
	o := reader.Options{AttachTimeout: 10 * time.Second}
	if len(args) > 2 && args[2] == "now" {
		o.Start = reader.StartNow
	}
	var slow time.Duration
	if len(args) > 3 {
		us, _ := strconv.ParseInt(args[3], 10, 64)
		slow = time.Duration(us) * time.Microsecond
	}
	r, err := reader.Attach(name, o)
	if err != nil {
		fmt.Printf("check_reader attach failed: %s: %v\n", statusName(err), err)
		return 1
	}
	c := batchgen.NewChecker()
	ts := make([]batchgen.Tensor, 0, 2)
	for expected == 0 || c.Batches < expected {
		b, err2 := r.Acquire(-1)
		if err2 != nil {
			err = err2
			break
		}
		if b == nil {
			continue
		}
		if b.EpochEnd() {
			if len(b.Tensors) != 0 {
				fmt.Printf("MISMATCH batch seq=%d: epoch-end marker with tensors\n", b.Seq)
				return 2
			}
			c.Marker()
		} else {
			ts = ts[:0]
			for _, x := range b.Tensors {
				ts = append(ts, batchgen.Tensor(x))
			}
			if err := c.Data(ts, b.Meta); err != nil {
				fmt.Printf("MISMATCH batch seq=%d: %v\n", b.Seq, err)
				return 2
			}
		}
		if slow > 0 {
			time.Sleep(slow)
		}
		if err = r.Release(b); err != nil {
			break
		}
	}
	code := 0
	switch {
	case errors.Is(err, reader.ErrClosed) || errors.Is(err, reader.ErrProducerGone):
		fmt.Printf("check_reader status=%s\n", statusName(err))
		if errors.Is(err, reader.ErrProducerGone) {
			code = 3
		}
	case err != nil:
		fmt.Printf("check_reader error %s: %v\n", statusName(err), err)
		code = 1
	}
	r.Detach()
	fmt.Println(c.Line())
	return code
}

func statusName(err error) string {
	names := map[int]string{
		ring.StatusClosed: "TSOCK_ECLOSED", ring.StatusProducerGone: "TSOCK_EPRODUCER_GONE",
		ring.StatusEvicted: "TSOCK_EEVICTED", ring.StatusNoEnt: "TSOCK_ENOENT",
		ring.StatusTimedOut: "TSOCK_ETIMEDOUT", ring.StatusCorrupt: "TSOCK_ECORRUPT",
		ring.StatusState: "TSOCK_ESTATE",
	}
	st := ring.StatusOf(err)
	if n, ok := names[st]; ok {
		return n
	}
	return fmt.Sprintf("TSOCK_STATUS(%d)", st)
}

// producerSpec describes a producer child.
type producerSpec struct {
	readers    int
	batches    uint64
	epochEvery uint64
	slots      uint32
}

// startProducer starts a Go producer child (TestHelperProducer).
func startProducer(t *testing.T, name string, s producerSpec) *proc {
	t.Helper()
	args := fmt.Sprintf("%s %d %d %d %d", name, s.readers, s.batches, s.epochEvery, s.slots)
	return start(t, "producer", []string{envRole + "=producer", envArgs + "=" + args},
		os.Args[0], "-test.run=^TestHelperProducer$")
}

// TestHelperProducer is a producer child: NAME READERS BATCHES EPOCH_EVERY
// SLOTS. It creates the channel, prints "producer created", waits for
// READERS readers, publishes BATCHES test batches (an epoch-end marker after
// every EPOCH_EVERY), waits until every reader has released everything,
// prints "producer published <N> fold=<hex>" and then blocks until killed.
func TestHelperProducer(t *testing.T) {
	if os.Getenv(envRole) != "producer" {
		t.Skip("helper process")
	}
	os.Exit(helperProducer(strings.Fields(os.Getenv(envArgs))))
}

func helperProducer(args []string) int {
	if len(args) != 5 {
		fmt.Println("usage: NAME READERS BATCHES EPOCH_EVERY SLOTS")
		return 1
	}
	name := args[0]
	nr, _ := strconv.Atoi(args[1])
	n, _ := strconv.ParseUint(args[2], 10, 64)
	every, _ := strconv.ParseUint(args[3], 10, 64)
	slots, _ := strconv.ParseUint(args[4], 10, 32)
	p, err := producer.Create(name, producer.Options{Slots: uint32(slots), SlotBytes: batchgen.MaxPayload})
	if err != nil {
		fmt.Println("producer error:", err)
		return 1
	}
	fmt.Println("producer created")
	if err := p.WaitReaders(nr, 30*time.Second); err != nil {
		fmt.Println("producer error:", err)
		return 1
	}
	fold := batchgen.FNVBasis
	for i := uint64(0); i < n; i++ {
		h, err := publish(p, i, 30*time.Second)
		if err != nil {
			fmt.Println("producer error:", err)
			return 1
		}
		fold = batchgen.Fold(fold, h)
		if every > 0 && (i+1)%every == 0 {
			if err := p.EndEpoch(30 * time.Second); err != nil {
				fmt.Println("producer error:", err)
				return 1
			}
		}
	}
	if err := waitDrained(p, 30*time.Second); err != nil {
		fmt.Println("producer error:", err)
		return 1
	}
	fmt.Printf("producer published %d fold=%016x\n", n, fold)
	select {} // until killed
}

// waitDrained waits until every live reader has released every published
// batch.
func waitDrained(p *producer.Producer, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for {
		pub := p.Stats().Published
		behind := 0
		for _, r := range p.Readers() {
			if r.Cursor < pub {
				behind++
			}
		}
		if behind == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("%d readers still behind batch %d after %v", behind, pub, timeout)
		}
		time.Sleep(time.Millisecond)
	}
}

// publish publishes test batch i and returns its meta hash.
func publish(p *producer.Producer, i uint64, timeout time.Duration) (uint64, error) {
	buf, err := p.Reserve(batchgen.PayloadBytes(i), timeout)
	if err != nil {
		return 0, err
	}
	ts, meta := batchgen.Write(buf, i)
	if err := p.Publish(ts, meta); err != nil {
		return 0, err
	}
	return binary.LittleEndian.Uint64(meta), nil
}

func tensors(b *reader.Batch) []batchgen.Tensor {
	out := make([]batchgen.Tensor, len(b.Tensors))
	for k, x := range b.Tensors {
		out[k] = batchgen.Tensor(x)
	}
	return out
}

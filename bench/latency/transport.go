package main

import (
	"encoding/binary"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

// descriptorBytes is what a reader learns about a one-tensor batch: its
// tsock_batch_t and one tsock_tensor_t (64 + 160 bytes). The Unix-socket
// baseline sends messages of this size.
const descriptorBytes = 224

// buildHelper compiles helper/tbench.c with the C reader sources (every C
// file of reader/) into dir, with libzmq: the library file TBENCH_LIBZMQ
// names (bench/run.py names the one inside pyzmq's wheel;
// helper/zmq_subset.h declares what tbench calls, so no libzmq headers are
// needed), else the one pkg-config finds. It returns the program and
// whether it has the ZMQ roles.
func buildHelper(repo, dir string) (string, bool, error) {
	cc := os.Getenv("CC")
	if cc == "" {
		cc = "cc"
	}
	exe := filepath.Join(dir, "tbench")
	readerSources, _ := filepath.Glob(filepath.Join(repo, "reader", "*.c"))
	args := append([]string{"-O2", "-std=gnu11", "-Wall", "-Wextra", "-Werror",
		"-I" + filepath.Join(repo, "include"), "-I" + filepath.Join(repo, "ring"),
		filepath.Join(repo, "bench", "latency", "helper", "tbench.c")}, readerSources...)
	args = append(args, "-ldl", "-lpthread", "-o", exe)
	withZmq := false
	if lib := os.Getenv("TBENCH_LIBZMQ"); lib != "" {
		args = append(args, "-DTBENCH_ZMQ", "-DTBENCH_ZMQ_SUBSET", lib, "-Wl,-rpath,"+filepath.Dir(lib))
		withZmq = true
	} else if flags, err := exec.Command("pkg-config", "--cflags", "--libs", "libzmq").Output(); err == nil {
		args = append(append(args, "-DTBENCH_ZMQ"), strings.Fields(string(flags))...)
		withZmq = true
	}
	if out, err := exec.Command(cc, args...).CombinedOutput(); err != nil {
		return "", false, fmt.Errorf("building %s: %v\n%s", exe, err, out)
	}
	return exe, withZmq, nil
}

// repoRoot is the checkout this source file lives in.
func repoRoot() string {
	_, file, _, _ := runtime.Caller(0)
	return filepath.Join(filepath.Dir(file), "..", "..")
}

// attachReaders starts n C tsock readers (tbench ROLE NAME args...) and
// waits until they are attached to p.
func attachReaders(cfg config, p *producer.Producer, role, name string, n int, args ...string) ([]*child, error) {
	var children []*child
	for i := 0; i < n; i++ {
		c, err := startProgram(cfg.helper, append([]string{role, name}, args...)...)
		if err != nil {
			killAll(children)
			return nil, err
		}
		children = append(children, c)
	}
	deadline := time.Now().Add(20 * time.Second)
	for p.WaitReaders(n, 20*time.Millisecond) != nil {
		for _, c := range children {
			if c.Exited() {
				killAll(children)
				return nil, fmt.Errorf("reader %d exited before attaching: %v", c.Pid(), c.Err())
			}
		}
		if time.Now().After(deadline) {
			killAll(children)
			return nil, fmt.Errorf("%d readers did not attach within 20 s", n)
		}
	}
	return children, nil
}

func killAll(children []*child) {
	for _, c := range children {
		c.Kill()
	}
}

// finishAll collects every child's samples and counters.
func finishAll(children []*child, timeout time.Duration) ([][]uint64, []childCounters, error) {
	var samples [][]uint64
	var cnts []childCounters
	for _, c := range children {
		v, err := c.finish(timeout)
		if err != nil {
			killAll(children)
			return nil, nil, err
		}
		s, cnt := splitCounters(v)
		samples = append(samples, s)
		cnts = append(cnts, cnt)
	}
	return samples, cnts, nil
}

// socketPeers starts the sender and the receivers of a socket baseline
// (uds or zmq). seconds bounds the run; interval 0 sends flat out, then
// receivers only time the run (warm-up -1).
func socketPeers(cfg config, transport, mode string, readers int, interval time.Duration, seconds float64,
	msgBytes uint64, touch bool, hwm int) (sender *child, recv []*child, err error) {
	warm := strconv.Itoa(cfg.warmup)
	if interval == 0 {
		warm = "-1"
	}
	t := "0"
	if touch {
		t = "1"
	}
	secs := strconv.FormatFloat(seconds, 'f', 3, 64)
	var addr string
	switch transport {
	case "uds":
		addr = fmt.Sprintf("/tmp/tsock-bench-%d-%d.sock", os.Getpid(), time.Now().UnixNano())
		sender, err = startProgram(cfg.helper, "uds-send", addr, strconv.Itoa(readers),
			strconv.FormatInt(int64(interval), 10), secs, strconv.FormatUint(msgBytes, 10))
	case "zmq":
		if !cfg.helperZmq {
			return nil, nil, fmt.Errorf("the helper was built without libzmq (install libzmq3-dev)")
		}
		l, lerr := net.Listen("tcp", "127.0.0.1:0")
		if lerr != nil {
			return nil, nil, lerr
		}
		addr = "tcp://" + l.Addr().String()
		l.Close()
		sender, err = startProgram(cfg.helper, "zmq-pub", addr, strconv.Itoa(readers),
			strconv.FormatInt(int64(interval), 10), secs, strconv.FormatUint(msgBytes, 10), strconv.Itoa(hwm))
	default:
		return nil, nil, fmt.Errorf("unknown transport %q", transport)
	}
	if err != nil {
		return nil, nil, err
	}
	time.Sleep(20 * time.Millisecond) // let it bind
	for i := 0; i < readers; i++ {
		var c *child
		if transport == "uds" {
			c, err = startProgram(cfg.helper, "uds-recv", addr, mode, warm)
		} else {
			c, err = startProgram(cfg.helper, "zmq-sub", addr, mode, warm, t, strconv.Itoa(hwm))
		}
		if err != nil {
			sender.Kill()
			killAll(recv)
			return nil, nil, err
		}
		recv = append(recv, c)
	}
	return sender, recv, nil
}

// socketLatency is tsockLatency for the socket baselines: a paced C sender,
// `readers` C receivers.
func socketLatency(cfg config, transport, mode string, readers int) (stats, time.Duration, error) {
	runtime.LockOSThread() // Pdeathsig
	defer runtime.UnlockOSThread()
	iv := cfg.intervalFor(readers)
	total := cfg.samples + cfg.warmup
	seconds := min(cfg.maxTime.Seconds(), float64(total)*iv.Seconds())
	size := uint64(descriptorBytes)
	if transport == "zmq" {
		size = cfg.payload
	}
	sender, recv, err := socketPeers(cfg, transport, mode, readers, iv, seconds, size, false, 1000)
	if err != nil {
		return stats{}, 0, err
	}
	timeout := time.Duration(seconds*float64(time.Second)) + 30*time.Second
	if err := sender.Wait(timeout); err != nil {
		killAll(recv)
		return stats{}, 0, fmt.Errorf("%s sender: %w", transport, err)
	}
	samples, cnts, err := finishAll(recv, 10*time.Second)
	if err != nil {
		return stats{}, 0, err
	}
	var pooled []uint64
	var missed uint64
	for i := range samples {
		pooled = append(pooled, samples[i]...)
		missed += cnts[i].missed
	}
	st := summarize(pooled)
	st.missed = int(missed)
	return st, iv, nil
}

// tputRow is one throughput configuration: batches/s each reader received
// (median over repeats of the median reader) and what that is in bytes.
type tputRow struct {
	Transport    string    `json:"transport"`
	Readers      int       `json:"readers"`
	Bytes        uint64    `json:"bytes"`
	Touch        bool      `json:"touch"`
	Slots        uint32    `json:"slots"`
	BatchesPerS  float64   `json:"batches_per_s"`
	GBPerS       float64   `json:"gb_per_s"` // per reader
	AggGBPerS    float64   `json:"agg_gb_per_s"`
	Repeats      int       `json:"repeats"`
	Missed       uint64    `json:"missed"` // batches a reader did not get (PUB/SUB drops)
	Err          string    `json:"error,omitempty"`
	RepeatValues []float64 `json:"repeat_batches_per_s"`
}

// slotsFor is the ring depth for a batch size: deep for small batches,
// four 64 MiB batches at most.
func slotsFor(bytes uint64) uint32 {
	switch {
	case bytes >= 32<<20:
		return 4
	case bytes >= 4<<20:
		return 8
	default:
		return 16
	}
}

// throughputOnce runs one transport flat out for seconds and returns each
// reader's rate in batches/s and the batches missed.
func throughputOnce(cfg config, transport string, readers int, bytes uint64, slots uint32, touch bool, seconds float64) ([]float64, uint64, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var recv []*child
	t := "0"
	if touch {
		t = "1"
	}
	if transport == "tsock" {
		name := fmt.Sprintf("tsock-tput-%d-%d", os.Getpid(), time.Now().UnixNano()%1e9)
		p, err := producer.Create(name, producer.Options{Slots: slots, SlotBytes: bytes})
		if err != nil {
			return nil, 0, err
		}
		defer p.Close()
		recv, err = attachReaders(cfg, p, "tsock", name, readers, "default", "-1", t)
		if err != nil {
			return nil, 0, err
		}
		tensors := []producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{int64(bytes)}}}
		end := now() + uint64(seconds*1e9)
		for seq := uint64(0); now() < end; seq++ {
			buf, err := p.Reserve(bytes, 10*time.Second)
			if err != nil {
				killAll(recv)
				return nil, 0, err
			}
			binary.LittleEndian.PutUint64(buf, seq) // the readers check it; the rest is left as is
			if err := p.Publish(tensors, nil); err != nil {
				killAll(recv)
				return nil, 0, err
			}
		}
		if err := p.Close(); err != nil {
			killAll(recv)
			return nil, 0, err
		}
	} else {
		size := bytes
		if transport == "uds" {
			size = descriptorBytes
		}
		hwm := int(slots)
		if bytes <= 64<<10 {
			hwm = 1000 // ZMQ's default for small messages
		}
		sender, r, err := socketPeers(cfg, transport, "default", readers, 0, seconds, size, touch, hwm)
		if err != nil {
			return nil, 0, err
		}
		recv = r
		if err := sender.Wait(time.Duration(seconds*float64(time.Second)) + 30*time.Second); err != nil {
			killAll(recv)
			return nil, 0, fmt.Errorf("%s sender: %w", transport, err)
		}
	}
	samples, cnts, err := finishAll(recv, 30*time.Second)
	if err != nil {
		return nil, 0, err
	}
	var rates []float64
	var missed uint64
	for i, s := range samples {
		if len(s) != 2 || cnts[i].extra < 2 || s[1] <= s[0] {
			return nil, 0, fmt.Errorf("reader %d received %d batches: too few to time", i, cnts[i].extra)
		}
		rates = append(rates, float64(cnts[i].extra-1)/(float64(s[1]-s[0])/1e9))
		missed += cnts[i].missed
	}
	return rates, missed, nil
}

// median of a copy of v.
func median(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// throughput repeats throughputOnce and keeps the median.
func throughput(cfg config, transport string, readers int, bytes uint64, slots uint32, touch bool) tputRow {
	row := tputRow{Transport: transport, Readers: readers, Bytes: bytes, Slots: slots, Touch: touch, Repeats: cfg.repeats}
	for i := 0; i < cfg.repeats; i++ {
		rates, missed, err := throughputOnce(cfg, transport, readers, bytes, slots, touch, cfg.tputTime.Seconds())
		if err != nil {
			row.Err = err.Error()
			return row
		}
		row.RepeatValues = append(row.RepeatValues, median(rates))
		row.Missed += missed
	}
	row.BatchesPerS = median(row.RepeatValues)
	row.GBPerS = row.BatchesPerS * float64(bytes) / 1e9
	row.AggGBPerS = row.GBPerS * float64(readers)
	return row
}

// memRow is the in-process baseline for one size: memcpy and a read of
// every byte (the readers' loop) of batches taken in turn from a ring of
// `slots` batches, GB/s, median over repeats.
type memRow struct {
	Bytes      uint64  `json:"bytes"`
	Slots      uint32  `json:"slots"`
	MemcpyGBps float64 `json:"memcpy_gb_per_s"`
	ReadGBps   float64 `json:"read_gb_per_s"`
}

func memBandwidth(cfg config, bytes uint64, slots uint32) (memRow, error) {
	c, err := startProgram(cfg.helper, "memcpy", strconv.FormatUint(bytes, 10), strconv.Itoa(int(slots)),
		strconv.Itoa(2*cfg.repeats+1))
	if err != nil {
		return memRow{}, err
	}
	v, err := c.finish(60 * time.Second)
	if err != nil {
		return memRow{}, err
	}
	s, _ := splitCounters(v)
	k := len(s) / 2
	gbps := func(ns []uint64) float64 {
		f := make([]float64, len(ns))
		for i, x := range ns {
			f[i] = float64(bytes) / float64(x)
		}
		return median(f)
	}
	return memRow{Bytes: bytes, Slots: slots, MemcpyGBps: gbps(s[:k]), ReadGBps: gbps(s[k:])}, nil
}

// pairRow is one round of back-to-back medians (µs), 1 reader: each tsock
// figure right after its baseline, so that both run on the same placement
// of the vCPUs (a VM's vCPUs move between host cores, and the cache-line
// handoff changes several-fold with them).
type pairRow struct {
	CacheLine  float64 `json:"cache_line_us"`
	Spin       float64 `json:"tsock_spin_us"`
	Futex      float64 `json:"futex_us"`
	FutexTsock float64 `json:"tsock_futex_us"`
}

func pairedRounds(cfg config, shm *sharedPage) ([]pairRow, error) {
	c := cfg
	c.samples = max(2000, cfg.samples/cfg.pairs)
	c.maxTime = max(time.Second, cfg.maxTime/time.Duration(cfg.pairs))
	var rows []pairRow
	for i := 0; i < cfg.pairs; i++ {
		shm.reset()
		cl, err := pingPong(c, shm)
		if err != nil {
			return nil, fmt.Errorf("cache-line baseline: %w", err)
		}
		sp, _, err := tsockLatency(c, "spin", 1)
		if err != nil {
			return nil, err
		}
		shm.reset()
		fx, err := futexBaseline(c, shm)
		if err != nil {
			return nil, fmt.Errorf("futex baseline: %w", err)
		}
		ft, _, err := tsockLatency(c, "futex", 1)
		if err != nil {
			return nil, err
		}
		rows = append(rows, pairRow{CacheLine: cl.median, Spin: sp.median, Futex: fx.median, FutexTsock: ft.median})
	}
	return rows, nil
}

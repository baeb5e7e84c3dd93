package main

import (
	"bytes"
	"crypto/rand"
	"encoding/binary"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/childproc"
)

// Offsets in the shared page of the baselines; each hot word has its own
// cache line.
const (
	offPing    = 0   // uint64, written by the parent
	offPong    = 64  // uint64, written by the child
	offReady   = 128 // uint32, the child has mapped the page
	offWord    = 192 // uint32, the futex word
	offStop    = 196 // uint32, the futex child should exit
	offStamps  = 256 // [stampSlots]uint64, stamp of wake-up i at i % stampSlots
	stampSlots = 64
	pageBytes  = 4096
)

// sharedPage is a page of /dev/shm mapped by the parent and one child.
type sharedPage struct {
	path string
	mem  []byte
}

// newSharedPage creates and maps a fresh page.
func newSharedPage() (*sharedPage, error) {
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	path := fmt.Sprintf("/dev/shm/tsock-latency-%d-%s", os.Getpid(), hex.EncodeToString(rnd[:]))
	f, err := os.OpenFile(path, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if err := f.Truncate(pageBytes); err != nil {
		os.Remove(path)
		return nil, err
	}
	mem, err := unix.Mmap(int(f.Fd()), 0, pageBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		os.Remove(path)
		return nil, err
	}
	return &sharedPage{path: path, mem: mem}, nil
}

// mapSharedPage maps the page a parent created.
func mapSharedPage(path string) (*sharedPage, error) {
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	mem, err := unix.Mmap(int(f.Fd()), 0, pageBytes, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		return nil, err
	}
	return &sharedPage{path: path, mem: mem}, nil
}

func (s *sharedPage) u64(off int) *uint64 { return (*uint64)(unsafe.Pointer(&s.mem[off])) }
func (s *sharedPage) u32(off int) *uint32 { return (*uint32)(unsafe.Pointer(&s.mem[off])) }

// reset zeroes the page between two baselines.
func (s *sharedPage) reset() { clear(s.mem) }

// remove unmaps and unlinks the page.
func (s *sharedPage) remove() {
	_ = unix.Munmap(s.mem)
	_ = os.Remove(s.path)
}

// child is a helper process whose stdout carries its samples; what it
// says on stderr is passed through to ours and quoted in its errors (and
// the report's FAILED row).
type child struct {
	*childproc.Process
	stdout bytes.Buffer
}

// stderrKept bounds what is kept of a child's stderr for its error.
const stderrKept = 512

// startChild re-executes this binary in role with args. The child gets
// SIGKILL if the parent dies. The caller must hold its OS thread locked
// (runtime.LockOSThread): Pdeathsig follows the forking thread.
func startChild(role string, args ...string) (*child, error) {
	self, err := os.Executable()
	if err != nil {
		return nil, err
	}
	return startProgram(self, append([]string{childArg, role, strconv.Itoa(os.Getpid())}, args...)...)
}

// startProgram runs path with args as a child (see startChild); the C
// helper (helper/tbench.c) writes its samples in the same format.
func startProgram(path string, args ...string) (*child, error) {
	c := &child{}
	p, err := childproc.Start(path, args, childproc.Options{Label: "child", Stdout: &c.stdout, Stderr: os.Stderr,
		Keep: stderrKept})
	if err != nil {
		return nil, err
	}
	c.Process = p
	return c, nil
}

// finish waits up to timeout for the child and decodes its samples.
func (c *child) finish(timeout time.Duration) ([]uint64, error) {
	if err := c.Wait(timeout); err != nil {
		return nil, err
	}
	return decodeSamples(c.stdout.Bytes())
}

// writeSamples sends samples to the parent: a count, then the values, then
// two counters (see childCounters), all uint64 little-endian.
func writeSamples(samples []uint64, missed, extra uint64) error {
	b := make([]byte, 8*(len(samples)+3))
	binary.LittleEndian.PutUint64(b, uint64(len(samples)))
	for i, v := range samples {
		binary.LittleEndian.PutUint64(b[8*(i+1):], v)
	}
	binary.LittleEndian.PutUint64(b[8*(len(samples)+1):], missed)
	binary.LittleEndian.PutUint64(b[8*(len(samples)+2):], extra)
	_, err := os.Stdout.Write(b)
	return err
}

// childCounters are the two counters a child sends after its samples.
type childCounters struct {
	missed uint64 // tsock reader: batches skipped in the sequence
	extra  uint64 // tsock reader: batches seen; futex: wake-ups that found the waiter awake
}

// decodeSamples reads what writeSamples wrote; the counters are appended
// as the last two values.
func decodeSamples(b []byte) ([]uint64, error) {
	if len(b) < 8 {
		return nil, errors.New("child sent no samples")
	}
	n := binary.LittleEndian.Uint64(b)
	if uint64(len(b)) != 8*(n+3) {
		return nil, fmt.Errorf("child sent %d bytes for %d samples", len(b), n)
	}
	out := make([]uint64, n+2)
	for i := range out {
		out[i] = binary.LittleEndian.Uint64(b[8*(i+1):])
	}
	return out, nil
}

// splitCounters separates decodeSamples' output into samples and counters.
func splitCounters(v []uint64) ([]uint64, childCounters) {
	k := len(v) - 2
	return v[:k], childCounters{missed: v[k], extra: v[k+1]}
}

// checkParent exits the child if the parent pid given on the command line
// is no longer its parent (it died before Pdeathsig was armed).
func checkParent(args []string) ([]string, error) {
	if len(args) == 0 {
		return nil, errors.New("missing parent pid")
	}
	pid, err := strconv.Atoi(args[0])
	if err != nil || os.Getppid() != pid {
		return nil, fmt.Errorf("parent %s is gone", args[0])
	}
	return args[1:], nil
}

// waitFlag spins (with short sleeps) until *w != 0, the child dies, or
// the timeout passes.
func waitFlag(w *uint32, c *child, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	for atomic.LoadUint32(w) == 0 {
		if c.Exited() {
			return fmt.Errorf("child exited early: %v", c.Err())
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("child not ready within %v", timeout)
		}
		time.Sleep(100 * time.Microsecond)
	}
	return nil
}

// pingPong measures the cache-line handoff: the parent stores i in ping
// and spins until the child echoes it in pong.
func pingPong(cfg config, shm *sharedPage) (stats, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	c, err := startChild("pingpong", shm.path)
	if err != nil {
		return stats{}, err
	}
	defer c.Kill()
	if err := waitFlag(shm.u32(offReady), c, 10*time.Second); err != nil {
		return stats{}, err
	}
	ping, pong := shm.u64(offPing), shm.u64(offPong)
	var died error
	samples := takeSamples(cfg.samples*4, cfg.warmup, now()+uint64(cfg.maxTime), func(i uint64) (uint64, uint64, bool) {
		t0 := now()
		atomic.StoreUint64(ping, i)
		for spins := 0; atomic.LoadUint64(pong) != i; spins++ {
			if spins&0xfffff == 0xfffff && c.Exited() {
				died = fmt.Errorf("ping-pong child died: %v", c.Err())
				return 0, 0, false
			}
		}
		return t0, now(), true
	})
	if died != nil {
		return stats{}, died
	}
	atomic.StoreUint64(ping, ^uint64(0))
	if _, err := c.finish(5 * time.Second); err != nil {
		return stats{}, err
	}
	return summarize(samples), nil
}

// minSamples is the fewest round trips takeSamples keeps when the deadline
// passes first: on a loaded machine the warm-up alone can outlast it, and a
// baseline of no samples (NaN) would fail the whole report.
const minSamples = 16

// takeSamples runs round trip i = 1, 2, ... (roundTrip returns its start
// and end times, or false to stop) and keeps half of each one's duration,
// after `warmup` of them, until it has n or the deadline has passed. Past
// the deadline it stops warming up and stops once it has minSamples.
func takeSamples(n, warmup int, deadline uint64, roundTrip func(i uint64) (t0, t1 uint64, ok bool)) []uint64 {
	samples := make([]uint64, 0, n)
	warm := uint64(warmup)
	for i := uint64(1); i <= warm+uint64(n); i++ {
		t0, t1, ok := roundTrip(i)
		if !ok {
			break
		}
		if i > warm {
			samples = append(samples, (t1-t0)/2)
		}
		if t1 > deadline {
			if len(samples) >= min(minSamples, n) {
				break
			}
			warm = min(warm, i) // out of time while warming up: measure what can be measured
		}
	}
	return samples
}

// pingPongChild echoes ping into pong until ping is all ones.
func pingPongChild(args []string) error {
	args, err := checkParent(args)
	if err != nil {
		return err
	}
	shm, err := mapSharedPage(args[0])
	if err != nil {
		return err
	}
	ping, pong := shm.u64(offPing), shm.u64(offPong)
	atomic.StoreUint32(shm.u32(offReady), 1)
	var last uint64
	for {
		v := atomic.LoadUint64(ping)
		if v == last {
			continue
		}
		if v == ^uint64(0) {
			return writeSamples(nil, 0, 0)
		}
		atomic.StoreUint64(pong, v)
		last = v
	}
}

// futex(2) operations, shared (no FUTEX_PRIVATE_FLAG) as tsock's words.
const (
	futexWaitOp = 0
	futexWakeOp = 1
)

// futexWait sleeps on a shared (not process-private) futex while *w ==
// val. It returns the errno: 0 after a wake-up, EAGAIN if *w != val.
func futexWait(w *uint32, val uint32) syscall.Errno {
	_, _, e := unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWaitOp, uintptr(val), 0, 0, 0)
	return e
}

// futexWake wakes up to n sleepers on w.
func futexWake(w *uint32, n int) {
	_, _, _ = unix.Syscall6(unix.SYS_FUTEX, uintptr(unsafe.Pointer(w)), futexWakeOp, uintptr(n), 0, 0, 0)
}

// pacer sleeps until absolute CLOCK_MONOTONIC deadlines one interval
// apart, without catching up in bursts after an oversleep. It must run on
// a locked OS thread: the timer slack it sets is per thread.
type pacer struct {
	interval uint64
	next     uint64
	spin     bool // busy-wait instead of sleeping
}

// newPacer sets the calling thread's timer slack to 1 ns so that sleeps
// end close to the deadline (the default slack is 50 µs). With spin it
// busy-waits instead, which costs a CPU.
func newPacer(interval time.Duration, spin bool) *pacer {
	_ = unix.Prctl(unix.PR_SET_TIMERSLACK, 1, 0, 0, 0)
	return &pacer{interval: uint64(interval), next: now(), spin: spin}
}

// wait sleeps until the next deadline.
func (p *pacer) wait() {
	p.next += p.interval
	t := now()
	if t >= p.next {
		p.next = t
		return
	}
	if p.spin {
		for now() < p.next {
		}
		return
	}
	ts := unix.NsecToTimespec(int64(p.next))
	for unix.ClockNanosleep(unix.CLOCK_MONOTONIC, unix.TIMER_ABSTIME, &ts, nil) == unix.EINTR {
	}
}

// futexBaseline measures FUTEX_WAKE to waiter running: the parent stamps
// the time, bumps the word and wakes; the child, asleep on the word,
// subtracts the stamp from its clock on waking.
func futexBaseline(cfg config, shm *sharedPage) (stats, error) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	var c *child
	var err error
	if cfg.helper != "" { // the waiter is then a C process, like the tsock readers
		c, err = startProgram(cfg.helper, "futex-wait", shm.path, strconv.Itoa(cfg.warmup))
	} else {
		c, err = startChild("futex", shm.path, strconv.Itoa(cfg.warmup))
	}
	if err != nil {
		return stats{}, err
	}
	defer c.Kill()
	if err := waitFlag(shm.u32(offReady), c, 10*time.Second); err != nil {
		return stats{}, err
	}
	word := shm.u32(offWord)
	pace := newPacer(cfg.interval, cfg.paceSpin)
	deadline := now() + uint64(cfg.maxTime)
	for i := uint32(1); i <= uint32(cfg.samples+cfg.warmup); i++ {
		pace.wait()
		atomic.StoreUint64(shm.u64(offStamps+8*int(i%stampSlots)), now())
		atomic.StoreUint32(word, i)
		futexWake(word, 1)
		if now() > deadline {
			break
		}
	}
	atomic.StoreUint32(shm.u32(offStop), 1)
	atomic.AddUint32(word, 1)
	futexWake(word, 1)
	v, err := c.finish(5 * time.Second)
	if err != nil {
		return stats{}, err
	}
	samples, cnt := splitCounters(v)
	st := summarize(samples)
	st.lateWakeup = int(cnt.extra)
	return st, nil
}

// futexChild sleeps on the word and records each wake-up's latency.
func futexChild(args []string) error {
	args, err := checkParent(args)
	if err != nil {
		return err
	}
	if len(args) != 2 {
		return errors.New("usage: futex PATH WARMUP")
	}
	warmup, _ := strconv.Atoi(args[1])
	shm, err := mapSharedPage(args[0])
	if err != nil {
		return err
	}
	word, stop := shm.u32(offWord), shm.u32(offStop)
	var samples []uint64
	var late uint64
	atomic.StoreUint32(shm.u32(offReady), 1)
	for {
		w := atomic.LoadUint32(word)
		if atomic.LoadUint32(stop) != 0 {
			break
		}
		e := futexWait(word, w)
		t := now()
		nw := atomic.LoadUint32(word)
		if nw == w { // spurious
			continue
		}
		if e != 0 { // the word moved before we slept: no wake-up to time
			late++
			continue
		}
		if atomic.LoadUint32(stop) != 0 {
			break
		}
		stamp := atomic.LoadUint64(shm.u64(offStamps + 8*int(nw%stampSlots)))
		if int(nw) > warmup && t >= stamp {
			samples = append(samples, t-stamp)
		}
	}
	return writeSamples(samples, 0, late)
}

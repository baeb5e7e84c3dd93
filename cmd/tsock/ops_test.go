package main

import (
	"bufio"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

func lsJSON(t *testing.T, args ...string) (lsResult, int) {
	t.Helper()
	rc, out, errs := runInProcess(t, append([]string{"ls", "--json"}, args...)...)
	var res lsResult
	require.NoError(t, json.Unmarshal([]byte(out), &res), "ls output:\n%s\nstderr:\n%s", out, errs)
	return res, rc
}

func findChannel(res lsResult, name string) *channelInfo {
	for i := range res.Channels {
		if res.Channels[i].Name == name {
			return &res.Channels[i]
		}
	}
	return nil
}

// TestLs lists a live channel with readers (one of them killed: its live
// producer frees its entry at once), a dead channel with readers (one of
// them killed after the producer: its entry stays, shown dead), a foreign
// file and a planted symbolic link.
func TestLs(t *testing.T) {
	live := chanName(t, "live")
	prod := startChild(t, "producer", live, "8", "-1")
	r1 := startChild(t, "reader", live)
	r2 := startChild(t, "reader", live)
	startChild(t, "reader", live)
	r2.Kill()
	orphaned := chanName(t, "orphaned")
	oprod := startChild(t, "producer", orphaned, "8", "-1")
	o2 := startChild(t, "reader", orphaned)
	oprod.Kill()
	o2.Kill() // after its producer: nobody frees its entry any more
	dead := deadChannel(t, "dead")
	foreign := chanName(t, "foreign")
	require.NoError(t, os.WriteFile(ring.ChannelPath(foreign), []byte("hello"), 0o600))
	link := chanName(t, "link")
	target := filepath.Join(t.TempDir(), "target")
	require.NoError(t, os.WriteFile(target, []byte("do not touch"), 0o600))
	require.NoError(t, os.Symlink(target, ring.ChannelPath(link)))

	var res lsResult
	var c, o *channelInfo
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		var rc int
		res, rc = lsJSON(t, live, orphaned, dead, foreign, link)
		require.Equal(t, exitOK, rc)
		require.Len(t, res.Channels, 5)
		c, o = findChannel(res, live), findChannel(res, orphaned)
		require.NotNil(t, c)
		require.NotNil(t, o)
		if (c.Readers == 2 && len(c.ReaderList) == 2 && o.DeadRecords == 1) || time.Now().After(deadline) {
			break
		}
	}
	assert.Equal(t, stateOpen, c.State)
	assert.Equal(t, int32(prod.Pid()), c.ProducerPid)
	assert.Equal(t, 2, c.Readers)
	assert.Equal(t, 0, c.DeadRecords)
	assert.Equal(t, uint32(8), c.Slots)
	assert.Equal(t, uint32(8), c.ReaderCapacity)
	assert.Equal(t, uint64(60<<10), c.SlotBytes) // batchgen.MaxPayload in pages
	assert.Equal(t, "0600", c.Mode)
	pids := map[int32]bool{}
	for _, r := range c.ReaderList {
		pids[r.Pid] = r.Alive
	}
	assert.True(t, pids[int32(r1.Pid())], "live reader shown alive")
	_, listed := pids[int32(r2.Pid())]
	assert.False(t, listed, "killed reader's entry freed by its producer")

	assert.Equal(t, stateDead, o.State)
	assert.Equal(t, 0, o.Readers)
	assert.Equal(t, 1, o.DeadRecords)
	pids = map[int32]bool{}
	for _, r := range o.ReaderList {
		pids[r.Pid] = r.Alive
	}
	alive, listed := pids[int32(o2.Pid())]
	assert.True(t, listed, "the entry of a reader killed after its producer is listed")
	assert.False(t, alive, "and shown dead")

	d := findChannel(res, dead)
	require.NotNil(t, d)
	assert.Equal(t, stateDead, d.State)
	f := findChannel(res, foreign)
	require.NotNil(t, f)
	assert.Equal(t, stateInvalid, f.State)
	assert.Contains(t, f.Error, "truncated")
	l := findChannel(res, link)
	require.NotNil(t, l)
	assert.Equal(t, stateInvalid, l.State)
	assert.Contains(t, l.Error, "symbolic link")

	// Table output and the full listing (the channels above are in it).
	rc, out, _ := runInProcess(t, "ls", "--readers")
	require.Equal(t, exitOK, rc)
	for _, want := range []string{"NAME", live, dead, "open", "dead", "0 +1 dead", "60 KiB"} {
		assert.Contains(t, out, want)
	}
	rc, out, _ = runInProcess(t, "ls", "--match", "clitest-"+strconv.Itoa(os.Getpid())+"-dead-*")
	require.Equal(t, exitOK, rc)
	assert.Contains(t, out, dead)
	assert.NotContains(t, out, live)

	// A name that does not exist, an invalid one.
	rc, _, errs := runInProcess(t, "ls", "no-such-channel-"+strconv.Itoa(os.Getpid()))
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, "no such channel")
	rc, _, _ = runInProcess(t, "ls", "--match", "[")
	assert.Equal(t, exitUsage, rc)

	b, err := os.ReadFile(target)
	require.NoError(t, err)
	assert.Equal(t, "do not touch", string(b))
}

// TestStat samples a channel with a producer publishing at a fixed rate
// and a fast reader, then adds a reader that never releases: the producer
// becomes back-pressured, the new reader lags by the whole ring, the fast
// reader waits for data all the time.
//
// The helper processes are paced by wall-clock tickers and get what CPU a
// loaded machine leaves them, so the figures of a 300 ms interval are not
// asserted as absolute rates or shares (at load 6-10 a producer on a
// 400/s ticker publishes ~30/s, a starved reader ends few waits). What is
// asserted instead holds at any load: each figure is > 0 where the
// process did the thing, it is exactly its count's growth over the
// interval stat reports (batches per second, seconds of wait per second),
// and the intervals are the --interval stat was given. A stat that
// reported 0, a count instead of a rate, a rate over the wrong interval or
// a share of the wrong time still fails.
func TestStat(t *testing.T) {
	name := chanName(t, "stat")
	prod := startChild(t, "producer", name, "8", "400")
	fast := startChild(t, "reader", name)

	// Take runs of three samples until one shows, in its last interval,
	// the producer publishing and the fast reader reading and ending a wait
	// (a reader starved for a whole interval may find data every time; the
	// producer's roster copy of the readers' counters may lag): within 20 s.
	var samples []statSample
	var s statSample
	var fr statReader
	for deadline := time.Now().Add(20 * time.Second); ; {
		t0 := time.Now()
		samples = statRun(t, name, 3)
		took := time.Since(t0).Seconds()
		// The three intervals follow a 300 ms ticker: together at least
		// 900 ms, and within the run (so: seconds, not milliseconds).
		var sum float64
		for _, x := range samples {
			sum += x.IntervalSec
		}
		assert.GreaterOrEqual(t, sum, 0.9, "stat's intervals: %+v", samples)
		assert.LessOrEqual(t, sum, took, "stat's intervals: %+v", samples)
		s = samples[len(samples)-1]
		fr = statReaderByPid(t, s, fast.Pid())
		if s.PublishRate > 0 && fr.BatchRate > 0 && fr.Stall > 0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "no interval with the producer publishing and the fast reader reading and waiting in 20 s: %+v", s)
	}
	assert.Equal(t, stateOpen, s.State)
	assert.Equal(t, int32(prod.Pid()), s.ProducerPid)
	assert.LessOrEqual(t, fr.Lag, uint64(8))
	// The rates and the stall of the later intervals are the growth of the
	// published count and of the reader's batches and wait time since the
	// sample before, over the interval (the first sample's start is not
	// printed). A stall is a share: at most 1.
	for i := 1; i < len(samples); i++ {
		prev, cur := samples[i-1], samples[i]
		dt := cur.IntervalSec
		require.Greater(t, dt, 0.0)
		require.GreaterOrEqual(t, cur.Published, prev.Published)
		assert.InDelta(t, float64(cur.Published-prev.Published)/dt, cur.PublishRate, 1e-6, "publish rate of sample %d", i)
		p, c := statReaderByPid(t, prev, fast.Pid()), statReaderByPid(t, cur, fast.Pid())
		require.False(t, c.New, "the fast reader is the same reader")
		require.GreaterOrEqual(t, c.Batches, p.Batches)
		require.GreaterOrEqual(t, c.WaitNs, p.WaitNs)
		assert.InDelta(t, float64(c.Batches-p.Batches)/dt, c.BatchRate, 1e-6, "fast reader's batch rate of sample %d", i)
		if cur.Published != prev.Published { // else a caught-up reader is shown stalled 100%
			assert.InDelta(t, clamp01(float64(c.WaitNs-p.WaitNs)/1e9/dt), c.Stall, 1e-9, "fast reader's stall of sample %d", i)
		}
		assert.LessOrEqual(t, c.Stall, 1.0)
	}
	// Averaged since the reader attached (the producer's roster says
	// when): before stat's three intervals of 300 ms. It waited (its
	// stall above is > 0), and the average is its whole wait time over
	// that time.
	assert.True(t, fr.SinceAttach, "the roster has the attach time")
	assert.Greater(t, fr.WatchedS, 0.8, "time since the reader attached")
	assert.Greater(t, fr.StallAvg, 0.0, "fast reader's average stall")
	assert.LessOrEqual(t, fr.StallAvg, 1.0)
	assert.InDelta(t, clamp01(float64(fr.WaitNs)/1e9/fr.WatchedS), fr.StallAvg, 1e-9, "fast reader's average stall")

	// A reader that holds what it acquires (here: acquires nothing, never
	// releases) gates the producer once the ring is full.
	slow, err := reader.Attach(name, reader.Options{Start: reader.StartNow})
	require.NoError(t, err)
	defer slow.Detach()
	inProcess := func(s statSample) *statReader {
		for i := range s.Readers {
			if s.Readers[i].Pid == int32(os.Getpid()) {
				return &s.Readers[i]
			}
		}
		return nil
	}
	// Sample once the ring is full (the holding reader lags by all 8
	// slots): from then on nothing is published, however long the
	// producer took to fill it on a loaded machine.
	for deadline := time.Now().Add(20 * time.Second); ; {
		s = statRun(t, name, 1)[0]
		if sr := inProcess(s); sr != nil && sr.Lag == 8 {
			break
		}
		require.True(t, time.Now().Before(deadline), "the ring never filled behind the holding reader: %+v", s)
	}
	// Back-pressure is accounted when one of the producer's 100 ms waits
	// ends: a producer kept off the CPU ends none in some 300 ms interval.
	// Sample until an interval shows it waiting most of the time, and the
	// caught-up reader (counters copied by that producer) stalled: within
	// 20 s. A stat that never accounts back-pressure still fails.
	for deadline := time.Now().Add(20 * time.Second); ; {
		s = statRun(t, name, 1)[0]
		if s.Backpressure > 0.5 && statReaderByPid(t, s, fast.Pid()).Stall == 1.0 {
			break
		}
		require.True(t, time.Now().Before(deadline), "no interval with the producer back-pressured and the fast reader stalled in 20 s: %+v", s)
	}
	assert.Less(t, s.PublishRate, 20.0, "a full ring stops the producer")
	assert.LessOrEqual(t, s.Backpressure, 1.0)
	sr := inProcess(s)
	require.NotNil(t, sr, "in-process reader listed")
	assert.Equal(t, uint64(8), sr.Lag, "the holding reader lags by the whole ring")
	fr = statReaderByPid(t, s, fast.Pid())
	assert.Equal(t, 1.0, fr.Stall, "the caught-up reader waits all the time")

	// Human output.
	rc, out, errs := runInProcess(t, "stat", name, "--interval", "100ms", "--count", "1")
	require.Equal(t, exitOK, rc, errs)
	for _, want := range []string{"channel " + name, "READER", "LAG", "STALL", "AVG STALL", "reader reports", strconv.Itoa(fast.Pid())} {
		assert.Contains(t, out, want)
	}

	// Follows a new producer of the same name; stops when the name is gone.
	cmd, lines := statProcess(t, name)
	<-lines // one sample of the first producer
	prod.Kill()
	slow.Detach()
	prod2 := startChild(t, "producer", name, "8", "400")
	var sawNew bool
	deadline := time.After(20 * time.Second)
	for !sawNew {
		select {
		case l, ok := <-lines:
			require.True(t, ok, "stat ended early")
			var smp statSample
			if json.Unmarshal([]byte(l), &smp) == nil && smp.ProducerPid == int32(prod2.Pid()) {
				sawNew = true
			}
		case <-deadline:
			t.Fatal("stat did not follow the new producer")
		}
	}
	prod2.Kill()
	require.NoError(t, os.Remove(ring.ChannelPath(name)))
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	select {
	case err := <-done:
		var ee *exec.ExitError
		require.ErrorAs(t, err, &ee)
		assert.Equal(t, exitFail, ee.ExitCode())
	case <-time.After(20 * time.Second):
		cmd.Process.Kill()
		t.Fatal("stat kept running after the channel was removed")
	}

	rc, _, errs = runInProcess(t, "stat", "no-such-"+strconv.Itoa(os.Getpid()), "--count", "1")
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, "no channel")
	rc, _, _ = runInProcess(t, "stat", "../x")
	assert.Equal(t, exitUsage, rc)
	rc, _, _ = runInProcess(t, "stat")
	assert.Equal(t, exitUsage, rc)
}

// statRun runs `tsock stat --json` for n samples of 300 ms.
func statRun(t *testing.T, name string, n int) []statSample {
	t.Helper()
	rc, out, errs := runInProcess(t, "stat", name, "--interval", "300ms", "--count", strconv.Itoa(n), "--json")
	require.Equal(t, exitOK, rc, errs)
	var res []statSample
	sc := bufio.NewScanner(strings.NewReader(out))
	for sc.Scan() {
		var s statSample
		require.NoError(t, json.Unmarshal(sc.Bytes(), &s), "line %q", sc.Text())
		res = append(res, s)
	}
	require.Len(t, res, n, out)
	return res
}

// statProcess runs `tsock stat --json` with a short interval in a child
// process and returns its output lines.
func statProcess(t *testing.T, name string) (*exec.Cmd, <-chan string) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "stat", name, "--interval", "50ms", "--json")
	cmd.Env = append(os.Environ(), asMainEnv+"=1")
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, cmd.Start())
	t.Cleanup(func() { cmd.Process.Kill() })
	lines := make(chan string, 1000)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			lines <- sc.Text()
		}
		close(lines)
	}()
	return cmd, lines
}

func statReaderByPid(t *testing.T, s statSample, pid int) statReader {
	t.Helper()
	for _, r := range s.Readers {
		if r.Pid == int32(pid) {
			return r
		}
	}
	t.Fatalf("reader pid %d not in sample %+v", pid, s)
	return statReader{}
}

func TestRm(t *testing.T) {
	// A live channel is refused and left alone.
	live := chanName(t, "rmlive")
	startChild(t, "producer", live, "4", "100")
	rc, _, errs := runInProcess(t, "rm", live)
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, "live producer")
	_, err := os.Stat(ring.ChannelPath(live))
	require.NoError(t, err, "live channel kept")

	// A dead channel goes, readers that were attached notice.
	dead := chanName(t, "rmdead")
	prod := startChild(t, "producer", dead, "4", "100")
	rd, err := reader.Attach(dead, reader.Options{Start: reader.StartNow})
	require.NoError(t, err)
	defer rd.Detach()
	prod.Kill()
	rc, out, errs := runInProcess(t, "rm", dead)
	require.Equal(t, exitOK, rc, errs)
	assert.Contains(t, out, "removed "+dead)
	assert.Contains(t, out, "dead")
	_, err = os.Stat(ring.ChannelPath(dead))
	assert.ErrorIs(t, err, os.ErrNotExist)
	for {
		b, err := rd.Acquire(2 * time.Second)
		if err != nil {
			require.ErrorIs(t, err, reader.ErrProducerGone)
			break
		}
		require.NotNil(t, b, "no batch and no end")
		rd.Release(b)
	}

	// Temporary files: the dead creator's goes, the live one's stays.
	gone := exec.Command("true")
	require.NoError(t, gone.Run())
	deadTmp := fmt.Sprintf("%s/%s%d.clitest%d", ring.ShmDir, tmpPrefix, gone.Process.Pid, os.Getpid())
	liveTmp := fmt.Sprintf("%s/%s%d.clitest%d", ring.ShmDir, tmpPrefix, os.Getpid(), os.Getpid())
	for _, p := range []string{deadTmp, liveTmp} {
		require.NoError(t, os.WriteFile(p, nil, 0o600))
		t.Cleanup(func() { os.Remove(p) })
	}
	dead2 := deadChannel(t, "rmdead2")
	rc, out, errs = runInProcess(t, "rm", "--json", dead2)
	require.Equal(t, exitOK, rc, errs)
	var res rmResult
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	assert.Equal(t, []string{dead2}, res.Removed)
	assert.Contains(t, res.TempRemoved, deadTmp)
	assert.Contains(t, res.TempKept, liveTmp)
	_, err = os.Stat(deadTmp)
	assert.ErrorIs(t, err, os.ErrNotExist)
	_, err = os.Stat(liveTmp)
	assert.NoError(t, err)

	// A foreign file needs --force; a symbolic link is never followed or removed.
	foreign := chanName(t, "rmforeign")
	require.NoError(t, os.WriteFile(ring.ChannelPath(foreign), []byte("not a segment"), 0o600))
	rc, _, errs = runInProcess(t, "rm", foreign)
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, "--force")
	rc, _, errs = runInProcess(t, "rm", "--force", foreign)
	assert.Equal(t, exitOK, rc, errs)
	_, err = os.Stat(ring.ChannelPath(foreign))
	assert.ErrorIs(t, err, os.ErrNotExist)

	link := chanName(t, "rmlink")
	victim := deadChannel(t, "rmvictim") // a real dead segment behind the link
	require.NoError(t, os.Symlink(ring.ChannelPath(victim), ring.ChannelPath(link)))
	rc, _, errs = runInProcess(t, "rm", "--force", link)
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, "symbolic link")
	_, err = os.Lstat(ring.ChannelPath(link))
	assert.NoError(t, err, "link kept")
	_, err = os.Stat(ring.ChannelPath(victim))
	assert.NoError(t, err, "link target kept")

	// --all-dead, limited to this test's names.
	d3, d4 := deadChannel(t, "rmall-a"), deadChannel(t, "rmall-b")
	live2 := chanName(t, "rmall-live")
	startChild(t, "producer", live2, "4", "100")
	rc, out, errs = runInProcess(t, "rm", "--all-dead", "--json", "--match", fmt.Sprintf("clitest-%d-rmall-*", os.Getpid()))
	require.Equal(t, exitOK, rc, errs)
	res = rmResult{}
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	assert.ElementsMatch(t, []string{d3, d4}, res.Removed)
	_, err = os.Stat(ring.ChannelPath(live2))
	assert.NoError(t, err)

	// Bad names and usage.
	for _, bad := range []string{"..", "../tsock.x", "a/b", "/etc/passwd", ""} {
		rc, _, errs = runInProcess(t, "rm", bad)
		assert.Equal(t, exitFail, rc, "rm %q", bad)
		assert.Contains(t, errs, "invalid channel name", "rm %q", bad)
	}
	rc, _, _ = runInProcess(t, "rm")
	assert.Equal(t, exitUsage, rc)
	rc, _, _ = runInProcess(t, "rm", "--all-dead", "x")
	assert.Equal(t, exitUsage, rc)
	rc, _, errs = runInProcess(t, "rm", "no-such-"+strconv.Itoa(os.Getpid()))
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, "no channel")
}

// TestRmInProcessProducer: rm names the live producer it refuses to
// disturb; after a clean close the name is already gone.
func TestRmInProcessProducer(t *testing.T) {
	name := chanName(t, "rminproc")
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.NoError(t, err)
	rc, _, errs := runInProcess(t, "rm", name)
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, fmt.Sprintf("pid %d", os.Getpid()))
	require.NoError(t, p.Close())
	rc, _, _ = runInProcess(t, "rm", name)
	assert.Equal(t, exitFail, rc, "a closed channel's name is already gone")
}

func TestGpusWithoutDriver(t *testing.T) {
	if _, err := os.Stat("/proc/driver/nvidia"); err == nil {
		t.Skip("an NVIDIA driver is present")
	}
	rc, out, errs := runInProcess(t, "gpus")
	assert.Equal(t, exitOK, rc, errs)
	// The message, then the channels with a device pool that other
	// processes (tests running beside this one) may have open right now.
	first, rest, _ := strings.Cut(out, "\n")
	assert.Equal(t, msgNoDriver, first)
	for _, l := range strings.Split(strings.TrimSuffix(rest, "\n"), "\n") {
		assert.True(t, l == "" || strings.HasPrefix(l, "channel ") || strings.HasPrefix(l, "  "),
			"not a line of the channels' section: %q", l)
	}
	rc, out, _ = runInProcess(t, "gpus", "--json")
	assert.Equal(t, exitOK, rc)
	var rep gpuReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	assert.False(t, rep.DriverLoaded)
	assert.Equal(t, msgNoDriver, rep.Error)
	assert.Empty(t, rep.GPUs)
	assert.NotNil(t, rep.GPUs, "gpus is [] in JSON, not null")
	rc, _, _ = runInProcess(t, "gpus", "extra")
	assert.Equal(t, exitUsage, rc)
}

func TestGpusFakeTopology(t *testing.T) {
	saved := gpuQuery
	t.Cleanup(func() { gpuQuery = saved })
	gpuQuery = func() gpuReport {
		return gpuReport{DriverLoaded: true, DriverVersion: "550.54.15", NVMLVersion: "12.550.54.15", CUDAVersion: "12.4",
			GPUs: []gpuInfo{
				{Index: 0, Name: "NVIDIA H100 80GB HBM3", UUID: "GPU-aaaa", PCIBusID: "00000000:18:00.0",
					MemoryBytes: 80 << 30, MIG: "enabled", MIGDevices: []migInfo{
						{Index: 0, Name: "NVIDIA H100 80GB HBM3 MIG 3g.40gb", UUID: "MIG-1111", GPUInstance: 1, ComputeInstance: 0, MemoryBytes: 40 << 30},
						{Index: 1, UUID: "MIG-2222", GPUInstance: 2, ComputeInstance: 0, MemoryBytes: 20 << 30},
					}},
				{Index: 1, Name: "NVIDIA H100 80GB HBM3", UUID: "GPU-bbbb", MemoryBytes: 80 << 30, MIG: "disabled",
					MIGPending: "enabled", MIGDevices: []migInfo{}},
			}}
	}
	rc, out, _ := runInProcess(t, "gpus")
	require.Equal(t, exitOK, rc)
	for _, want := range []string{"NVIDIA driver 550.54.15", "CUDA 12.4", "2 GPUs", "GPU 0", "GPU-aaaa", "80 GiB", "MIG enabled",
		"MIG 0  MIG-1111  GPU instance 1  compute instance 0  40 GiB", "MIG 1  MIG-2222", "GPU 1", "MIG disabled (enabled after reset)",
		"CUDA IPC does not cross MIG instances"} {
		assert.Contains(t, out, want)
	}
	rc, out, _ = runInProcess(t, "gpus", "--json")
	require.Equal(t, exitOK, rc)
	var rep gpuReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep))
	require.Len(t, rep.GPUs, 2)
	assert.Len(t, rep.GPUs[0].MIGDevices, 2)
	assert.Equal(t, 2, rep.GPUs[0].MIGDevices[1].GPUInstance)

	gpuQuery = func() gpuReport {
		return gpuReport{Error: "NVML initialisation failed: Insufficient Permissions", failed: true}
	}
	rc, _, errs := runInProcess(t, "gpus")
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, errs, "Insufficient Permissions")
}

// TestNVMLStaysOutOfLibraries: go-nvml links into the tsock command only;
// libtsock.so (cabi) and the Go packages never depend on it.
func TestNVMLStaysOutOfLibraries(t *testing.T) {
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go tool not found")
	}
	const nvmlPkg = "github.com/NVIDIA/go-nvml"
	deps := func(pkgs ...string) string {
		out, err := exec.Command(gobin, append([]string{"list", "-deps"}, pkgs...)...).CombinedOutput()
		require.NoError(t, err, "%s", out)
		return string(out)
	}
	lib := deps("github.com/tsock/tsock/cabi", "github.com/tsock/tsock/producer", "github.com/tsock/tsock/reader",
		"github.com/tsock/tsock/ring")
	assert.NotContains(t, lib, nvmlPkg, "a library package depends on NVML")
	assert.Contains(t, deps("github.com/tsock/tsock/cmd/tsock"), nvmlPkg)
}

// TestToolsAsOtherUser: another user sees a private channel as no-access
// and cannot remove it.
func TestToolsAsOtherUser(t *testing.T) {
	testkit.NeedRoot(t)
	exe := testkit.ExecutableForOthers(t)
	name := chanName(t, "private")
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.NoError(t, err)
	defer p.Close()
	asNobody := func(args ...string) (int, string) {
		cmd := exec.Command(exe, args...)
		cmd.Env = append(os.Environ(), asMainEnv+"=1")
		cmd.SysProcAttr = testkit.AsUser(testkit.Nobody, testkit.Nobody)
		cmd.Dir = "/"
		out, err := cmd.CombinedOutput()
		var ee *exec.ExitError
		if err != nil && !errors.As(err, &ee) {
			t.Fatalf("tsock %v as nobody: %v", args, err)
		}
		return cmd.ProcessState.ExitCode(), string(out)
	}
	rc, out := asNobody("ls", "--json", name)
	require.Equal(t, exitOK, rc, out)
	var res lsResult
	require.NoError(t, json.Unmarshal([]byte(out), &res), out)
	require.Len(t, res.Channels, 1)
	assert.Equal(t, stateNoAccess, res.Channels[0].State)
	assert.Equal(t, "0600", res.Channels[0].Mode)
	rc, out = asNobody("rm", name)
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, out, "only its owner (uid 0) or root may remove it")
	rc, out = asNobody("stat", name, "--count", "1")
	assert.Equal(t, exitFail, rc)
	assert.Contains(t, out, "permission denied")
	_, err = os.Stat(ring.ChannelPath(name))
	assert.NoError(t, err, "still there")
}

// TestGpusShowsPlacement: tsock gpus lists a channel's device pool and what
// each live reader got (the header patched as a producer with a pool would
// write it; records written as readers on CUDA would write theirs, by
// readers that speak the join protocol themselves; no GPU here).
func TestGpusShowsPlacement(t *testing.T) {
	name := chanName(t, "gpus")
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.NoError(t, err)
	defer p.Close()
	gpu := [16]byte{0x11, 0x22, 0x33, 0x44, 0x55, 0x66, 0x77, 0x88, 0x99, 0xaa, 0xbb, 0xcc, 0xdd, 0xee, 0xff, 0x00}
	mig := gpu
	mig[15] = 0x01
	le32 := func(v uint32) []byte { return binary.LittleEndian.AppendUint32(nil, v) }
	placed := func(placement, ordinal uint32, uuid [16]byte) {
		r, err := testkit.JoinRogue(name, uint32(reader.StartNow))
		require.NoError(t, err)
		t.Cleanup(r.Close)
		copy(r.Rec.Bytes()[ring.RecordOffPlacement:], le32(placement))
		copy(r.Rec.Bytes()[ring.RecordOffCUDAOrdinal:], le32(ordinal))
		copy(r.Rec.Bytes()[ring.RecordOffGPUUUID:], uuid[:])
	}
	placed(ring.PlacementDevice, 0, gpu)
	placed(ring.PlacementPinned, 1, mig)
	r, err := reader.Attach(name, reader.Options{Start: reader.StartNow})
	require.NoError(t, err)
	defer r.Detach()
	placed(9, 0, [16]byte{}) // garbage a reader could write
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	put := func(off uintptr, b []byte) {
		_, err := f.WriteAt(b, int64(off))
		require.NoError(t, err)
	}
	put(ring.HeaderOffGPUPool, le32(1))
	put(ring.HeaderOffGPUOrdinal, le32(0))
	put(ring.HeaderOffGPUPoolBytes, binary.LittleEndian.AppendUint64(nil, 2*4096))
	put(ring.HeaderOffGPUUUID, gpu[:])
	// The producer mirrors records into the roster, which tools read.
	seg, err := ring.OpenSegment(name)
	require.NoError(t, err)
	defer seg.Close()
	for deadline := time.Now().Add(10 * time.Second); seg.Snapshot(3).Placement != 9; time.Sleep(time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "records never mirrored")
	}

	saved := gpuQuery
	t.Cleanup(func() { gpuQuery = saved })
	gpuQuery = func() gpuReport {
		return gpuReport{DriverLoaded: true, DriverVersion: "550", NVMLVersion: "12", CUDAVersion: "12.4",
			GPUs: []gpuInfo{{Index: 0, Name: "H100", UUID: "GPU-11223344-5566-7788-99aa-bbccddeeff00", MIG: "enabled",
				MIGDevices: []migInfo{{Index: 0, UUID: "MIG-11223344-5566-7788-99aa-bbccddeeff01"}}}}}
	}
	rc, out, errs := runInProcess(t, "gpus")
	require.Equal(t, exitOK, rc, errs)
	for _, want := range []string{
		"channel " + name + ": device pool of 8 KiB on GPU 0 (GPU-11223344-5566-7788-99aa-bbccddeeff00) (the producer's cuda:0)",
		"device      GPU 0 (GPU-11223344-5566-7788-99aa-bbccddeeff00), its cuda:0",
		"pinned      MIG 0 of GPU 0 (MIG-11223344-5566-7788-99aa-bbccddeeff01), its cuda:1",
		"reader 2  pid " + strconv.Itoa(os.Getpid()) + "  host",
		"invalid(9)",
	} {
		assert.Contains(t, out, want)
	}
	rc, out, _ = runInProcess(t, "gpus", "--json")
	require.Equal(t, exitOK, rc)
	var rep gpuReport
	require.NoError(t, json.Unmarshal([]byte(out), &rep), out)
	var ch *gpuChannel
	for i := range rep.Channels {
		if rep.Channels[i].Name == name {
			ch = &rep.Channels[i]
		}
	}
	require.NotNil(t, ch, out)
	require.NotNil(t, ch.Pool)
	assert.Equal(t, uint64(8192), ch.Pool.Bytes)
	require.Len(t, ch.Readers, 4)
	got := []string{}
	for _, r := range ch.Readers {
		got = append(got, r.Placement)
	}
	assert.Equal(t, []string{"device", "pinned", "host", "invalid(9)"}, got)
	assert.Equal(t, int32(1), *ch.Readers[1].CUDAIndex)

	// ls shows the placement too.
	rc, out, _ = runInProcess(t, "ls", "--readers", "--match", name)
	require.Equal(t, exitOK, rc)
	assert.Contains(t, out, "PLACEMENT")
	assert.Contains(t, out, "device")

}

// TestRmIgnoresReadLockOnProducerByte: any reader of a channel may take a
// read lock on the producer's byte; on a dead channel that keeps a new
// producer of the name from taking the write lock. The lock is no
// producer: Create says what holds the name, and tsock rm removes it.
// Before: rm took any lock there for a live producer and refused.
func TestRmIgnoresReadLockOnProducerByte(t *testing.T) {
	name := deadChannel(t, "rdlock")
	f, err := os.Open(ring.ChannelPath(name))
	require.NoError(t, err)
	defer f.Close()
	fl := unix.Flock_t{Type: unix.F_RDLCK, Start: ring.LockProducer, Len: 1}
	require.NoError(t, unix.FcntlFlock(f.Fd(), unix.F_OFD_SETLK, &fl))

	_, err = producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.ErrorIs(t, err, producer.ErrExist)
	assert.Contains(t, err.Error(), "read lock")

	rc, out, errs := runInProcess(t, "rm", name)
	require.Equal(t, exitOK, rc, "%s%s", out, errs)
	assert.Contains(t, out, "removed "+name)
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.NoError(t, err, "the name is free again")
	require.NoError(t, p.Close())
}

// TestCaches lists a decoded-sample cache file in use (a process holds a
// read lock on its users byte, as tsock.Pipeline's cache does) and one
// unused; rm --caches removes only the unused one, and another user's
// cache is listed but never removed.
func TestCaches(t *testing.T) {
	prefix := fmt.Sprintf("%s%d.%08x", cachePrefix, os.Geteuid(), os.Getpid())
	key := func(suffix string) string { return fmt.Sprintf("%024x", suffix[0]) } // 32 hex digits in all
	mk := func(suffix string) string {
		path := filepath.Join(shmDir, prefix+key(suffix))
		require.NoError(t, os.WriteFile(path, make([]byte, 3*4096), 0o600))
		t.Cleanup(func() { _ = os.Remove(path) })
		return path
	}
	used, unused := mk("a"), mk("b")
	user, err := os.Open(used)
	require.NoError(t, err)
	fl := unix.Flock_t{Type: unix.F_RDLCK, Start: cacheUsersByte, Len: 1}
	require.NoError(t, unix.FcntlFlock(user.Fd(), unix.F_OFD_SETLK, &fl))

	res, rc := lsJSON(t)
	require.Equal(t, 0, rc)
	byPath := map[string]cacheFile{}
	for _, c := range res.Caches {
		byPath[c.Path] = c
	}
	require.Contains(t, byPath, used)
	require.Contains(t, byPath, unused)
	assert.True(t, byPath[used].InUse)
	assert.False(t, byPath[unused].InUse)
	assert.Equal(t, os.Geteuid(), byPath[unused].UID)
	assert.GreaterOrEqual(t, byPath[unused].Bytes, uint64(3*4096))

	rc, out, errs := runInProcess(t, "rm", "--caches", "--match", prefix+"*", "--json")
	var rm rmResult
	require.NoError(t, json.Unmarshal([]byte(out), &rm), "rm output:\n%s\nstderr:\n%s", out, errs)
	assert.Equal(t, exitFail, rc, "the cache in use is refused")
	assert.Equal(t, []string{unused}, rm.Caches)
	require.Len(t, rm.Refused, 1)
	assert.Equal(t, used, rm.Refused[0].Name)
	assert.Contains(t, rm.Refused[0].Reason, "in use")
	assert.FileExists(t, used)
	assert.NoFileExists(t, unused)

	require.NoError(t, user.Close()) // its user is gone
	rc, _, errs = runInProcess(t, "rm", "--caches", "--match", prefix+"*")
	assert.Equal(t, exitOK, rc, errs)
	assert.NoFileExists(t, used)

	// A name that is not exactly a cache's is not listed: anyone may create
	// files in /dev/shm, and their names would reach the terminal.
	forged := filepath.Join(shmDir, prefix+"\x1b]0;owned\x07")
	require.NoError(t, os.WriteFile(forged, nil, 0o600))
	t.Cleanup(func() { _ = os.Remove(forged) })
	res, _ = lsJSON(t)
	for _, c := range res.Caches {
		assert.NotEqual(t, forged, c.Path, "a forged name is listed")
	}
	for _, bad := range []string{"tsock-cache.0.abc", "tsock-cache.00.0123456789abcdef0123456789abcdef",
		"tsock-cache.0.0123456789abcdef0123456789abcdef.9", "tsock-cache.0.0123456789ABCDEF0123456789abcdef"} {
		assert.Equal(t, -1, cacheUID(bad), bad)
	}
	assert.Equal(t, 0, cacheUID("tsock-cache.0.0123456789abcdef0123456789abcdef.3"))

	if os.Geteuid() != 0 {
		t.Log("not root: another user's cache file is not planted")
		return
	}
	theirs := mk("c")
	require.NoError(t, os.Chown(theirs, 4242, 4242))
	res, _ = lsJSON(t)
	found := false
	for _, c := range res.Caches {
		if c.Path == theirs {
			found = true
			assert.Equal(t, 4242, c.UID)
		}
	}
	assert.True(t, found, "another user's cache is listed")
	rc, _, _ = runInProcess(t, "rm", "--caches", "--match", prefix+"*")
	assert.Equal(t, exitOK, rc)
	assert.FileExists(t, theirs, "another user's cache is theirs to remove")
}

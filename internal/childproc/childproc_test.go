package childproc

import (
	"bytes"
	"errors"
	"fmt"
	"io"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// roleEnv makes the test binary, re-executed, play a child (see TestMain).
const roleEnv = "CHILDPROC_TEST_ROLE"

// TestMain runs a child role instead of the tests when roleEnv is set.
func TestMain(m *testing.M) {
	if role := os.Getenv(roleEnv); role != "" {
		os.Exit(playRole(role, os.Args[1:]))
	}
	os.Exit(m.Run())
}

// playRole is one of the children the tests start.
func playRole(role string, args []string) int {
	switch role {
	case "lines": // three stdout lines around a stderr one, then exit 3
		fmt.Println("one")
		fmt.Println("two")
		os.Stdout.Sync()
		fmt.Fprintln(os.Stderr, "on stderr")
		fmt.Println("three", os.Getenv("CHILDPROC_TEST_VALUE"))
		return 3
	case "binary": // raw bytes on stdout, a word on stderr
		os.Stdout.Write([]byte{0, 1, 2, 0xff})
		fmt.Fprint(os.Stderr, "said")
		return 0
	case "chattyerr": // many lines on stderr
		for i := range 1000 {
			fmt.Fprintln(os.Stderr, "line", i)
		}
		return 0
	case "echo": // stdin back to stdout
		io.Copy(os.Stdout, os.Stdin)
		return 0
	case "hang": // says so, then sleeps until killed
		fmt.Println("hanging")
		time.Sleep(time.Hour)
		return 0
	case "chatty": // many lines
		for i := range 1000 {
			fmt.Println("line", i)
		}
		return 0
	case "parent": // starts a sleeping grandchild, prints its pid, hangs
		runtime.LockOSThread()
		gc, err := Start("sleep", []string{"3600"}, Options{})
		if err != nil {
			fmt.Println("error", err)
			return 1
		}
		fmt.Println("grandchild", gc.Pid())
		time.Sleep(time.Hour)
		return 0
	}
	return 100
}

// startRole starts the test binary as role.
func startRole(t *testing.T, role string, o Options) *Process {
	t.Helper()
	o.Env = append(o.Env, roleEnv+"="+role)
	p, err := Start(os.Args[0], nil, o)
	require.NoError(t, err)
	t.Cleanup(p.Kill)
	return p
}

func TestLinesOutputAndExit(t *testing.T) {
	var lines []string
	p := startRole(t, "lines", Options{
		Env:    []string{"CHILDPROC_TEST_VALUE=v42"},
		OnLine: func(l string) { lines = append(lines, l) },
	})
	err := p.Wait(time.Minute)
	// lines is read only after Done: OnLine has returned for every line.
	assert.Equal(t, []string{"one", "two", "three v42"}, lines)
	assert.Equal(t, 3, p.ExitCode())
	require.Error(t, err)
	assert.False(t, errors.Is(err, ErrTimedOut), "%v", err)
	assert.Contains(t, err.Error(), "exit status 3")
	assert.Contains(t, err.Error(), "on stderr", "the error quotes what the child printed")
	// Whole lines from both streams; their order across the two pipes is
	// the readers' race, not the child's.
	for _, line := range []string{"one\n", "two\n", "three v42\n", "on stderr\n"} {
		assert.Contains(t, p.Output(), line)
	}
	assert.True(t, p.Exited())
	assert.False(t, p.Ended().IsZero())
}

func TestRawStdoutAndStderrCopy(t *testing.T) {
	var stdout, stderr bytes.Buffer
	p := startRole(t, "binary", Options{Stdout: &stdout, Stderr: &stderr, Label: "bin"})
	require.NoError(t, p.Wait(time.Minute))
	assert.Equal(t, []byte{0, 1, 2, 0xff}, stdout.Bytes())
	assert.Equal(t, "said", stderr.String())
	assert.Equal(t, "said", p.Output(), "Output holds stderr only when Stdout is taken")
	assert.Equal(t, "bin", p.Label())
	assert.Equal(t, 0, p.ExitCode())
}

func TestStdinPipe(t *testing.T) {
	var got []string
	p := startRole(t, "echo", Options{Stdin: true, OnLine: func(l string) { got = append(got, l) }})
	_, err := io.WriteString(p.Stdin, "ping\npong\n")
	require.NoError(t, err)
	require.NoError(t, p.Stdin.Close())
	require.NoError(t, p.Wait(time.Minute))
	assert.Equal(t, []string{"ping", "pong"}, got)
}

func TestWaitKillsAtTimeout(t *testing.T) {
	seen := make(chan string, 1)
	p := startRole(t, "hang", Options{OnLine: func(l string) { seen <- l }})
	select {
	case l := <-seen:
		require.Equal(t, "hanging", l)
	case <-time.After(time.Minute):
		t.Fatal("the child did not start")
	}
	err := p.Wait(50 * time.Millisecond)
	require.ErrorIs(t, err, ErrTimedOut)
	assert.Contains(t, err.Error(), "hanging", "the error quotes what the child printed")
	assert.Contains(t, err.Error(), "pid "+strconv.Itoa(p.Pid()))
	assert.True(t, p.Exited(), "Wait reaped the child it killed")
	assert.Equal(t, -1, p.ExitCode(), "killed by a signal")
}

func TestKeepBoundsOutput(t *testing.T) {
	p := startRole(t, "chatty", Options{Keep: 100})
	require.NoError(t, p.Wait(time.Minute))
	out := p.Output()
	assert.LessOrEqual(t, len(out), 100)
	assert.True(t, strings.HasSuffix(out, "line 999\n"), "the tail is kept: %q", out)
}

// TestChildDiesWithParent: the default attributes kill a child whose
// parent dies (Pdeathsig), so no helper outlives a killed test.
func TestChildDiesWithParent(t *testing.T) {
	gcPid := make(chan int, 1)
	parent := startRole(t, "parent", Options{OnLine: func(l string) {
		if v, ok := strings.CutPrefix(l, "grandchild "); ok {
			n, _ := strconv.Atoi(v)
			gcPid <- n
		}
	}})
	var pid int
	select {
	case pid = <-gcPid:
	case <-parent.Done():
		t.Fatalf("the parent ended first: %s", parent.Output())
	case <-time.After(time.Minute):
		t.Fatal("no grandchild started")
	}
	require.NoError(t, syscall.Kill(pid, 0), "the grandchild runs")
	parent.Kill()
	deadline := time.Now().Add(30 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			syscall.Kill(pid, syscall.SIGKILL)
			t.Fatalf("grandchild %d outlived its parent", pid)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// alive: pid exists and is not a zombie waiting for its new parent.
func alive(pid int) bool {
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}

func TestStartFailure(t *testing.T) {
	_, err := Start("/nonexistent/program", nil, Options{})
	require.Error(t, err)
	assert.Contains(t, err.Error(), "program")
}

// TestSerializedSharedStderr: children sharing one Stderr through
// Serialized (a bytes.Buffer is not safe for concurrent writes: without
// the lock the race detector fails this test, and lines can be lost).
func TestSerializedSharedStderr(t *testing.T) {
	var shared bytes.Buffer
	w := Serialized(&shared)
	var ps []*Process
	for range 4 {
		ps = append(ps, startRole(t, "chattyerr", Options{Stderr: w}))
	}
	for _, p := range ps {
		require.NoError(t, p.Wait(time.Minute))
	}
	assert.Equal(t, 4*1000, strings.Count(shared.String(), "\n"))
}

// TestWaitBoundHoldsWhenAGrandchildKeepsTheOutput: a child whose own child
// inherited its stdout and stderr and outlives it. Before the output was
// drained with a bound, Wait(200ms) waited for the grandchild (here 20 s).
func TestWaitBoundHoldsWhenAGrandchildKeepsTheOutput(t *testing.T) {
	for _, script := range []string{
		"sleep 20 & echo started; exec sleep 100",            // holds stdout and stderr
		"sleep 20 >/dev/null & echo started; exec sleep 100", // stderr only
	} {
		p, err := Start("sh", []string{"-c", script}, Options{Label: "sh"})
		require.NoError(t, err)
		t0 := time.Now()
		err = p.Wait(200 * time.Millisecond)
		require.ErrorIs(t, err, ErrTimedOut)
		assert.Less(t, time.Since(t0), drainIdle+10*time.Second, script)
	}
	// A child that exits 0 while its child still holds the output passes.
	p, err := Start("sh", []string{"-c", "sleep 20 & echo done"}, Options{})
	require.NoError(t, err)
	require.NoError(t, p.Wait(time.Minute))
	assert.Contains(t, p.Output(), "done")
}

// TestWaitOnAnExitedChildIsNotATimeout: with the child reaped, Wait(0)
// finds both its cases ready; it must report the exit, never ErrTimedOut.
func TestWaitOnAnExitedChildIsNotATimeout(t *testing.T) {
	p, err := Start("true", nil, Options{})
	require.NoError(t, err)
	<-p.Done()
	for range 200 {
		require.NoError(t, p.Wait(0))
	}
}

// TestSlowReadersGetEveryLine: a child that prints 20000 lines and exits
// while most of them are still in the pipe, read by a slow OnLine, and
// 40000 lines into a slow Stdout writer. The bound on reading after the
// exit (drainIdle) counts idle time only: with a fixed 2 s bound both
// lost their last lines (and a cut line reached OnLine), Wait saying nil.
func TestSlowReadersGetEveryLine(t *testing.T) {
	var lines []string
	p, err := Start("seq", []string{"1", "20000"}, Options{OnLine: func(l string) {
		lines = append(lines, l)
		time.Sleep(300 * time.Microsecond)
	}})
	require.NoError(t, err)
	require.NoError(t, p.Wait(time.Minute))
	require.Equal(t, 20000, len(lines), "lines OnLine got")
	assert.Equal(t, "20000", lines[len(lines)-1])

	w := &slowWriter{}
	p, err = Start("seq", []string{"1", "40000"}, Options{Stdout: w})
	require.NoError(t, err)
	require.NoError(t, p.Wait(time.Minute))
	w.mu.Lock()
	defer w.mu.Unlock()
	assert.True(t, strings.HasSuffix(w.b.String(), "\n39999\n40000\n"), "the report is cut")
}

type slowWriter struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (w *slowWriter) Write(b []byte) (int, error) {
	time.Sleep(1200 * time.Millisecond)
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.Write(b)
}

// TestExitedChildIsNoTimeoutWhileAGrandchildHoldsItsOutput: the child
// exits 0 at once; its own child keeps the output open, so the output is
// read on for drainIdle past the exit. A Wait whose bound ends after the
// exit but before that reports the exit (it waited on Done before, and
// called it a timeout), and Ended is the exit, not the end of the output.
//
// How soon sh forks, execs and exits depends on the machine's load, so the
// test does not bet on a bound after Start: it waits until the child has
// been reaped (its pid is gone), then calls Wait with a bound of
// drainIdle/2, which ends well before Done (at least drainIdle after the
// exit) and leaves drainIdle/2 for reap to record the exit it already
// waited for. Ended is checked against the end of the output, which comes
// at least drainIdle after the exit whatever the load: an Ended taken at
// the end of the output fails.
func TestExitedChildIsNoTimeoutWhileAGrandchildHoldsItsOutput(t *testing.T) {
	t0 := time.Now()
	p, err := Start("sh", []string{"-c", "sleep 60 & echo done"}, Options{})
	require.NoError(t, err)
	for deadline := time.Now().Add(30 * time.Second); syscall.Kill(p.Pid(), 0) == nil; time.Sleep(2 * time.Millisecond) {
		require.True(t, time.Now().Before(deadline), "sh not reaped after 30 s")
	}
	require.NoError(t, p.Wait(drainIdle/2))
	outputEnd := time.Now() // Wait returned after Done
	assert.False(t, p.Ended().Before(t0))
	assert.GreaterOrEqual(t, outputEnd.Sub(p.Ended()), drainIdle, "Ended is the end of the output, not the exit")
	assert.Equal(t, "done\n", p.Output())
}

// TestNoDescriptorLeftBehind: every Start/Wait closes its pipes, and the
// last, unterminated line is delivered.
func TestNoDescriptorLeftBehind(t *testing.T) {
	count := func() int {
		es, err := os.ReadDir("/proc/self/fd")
		require.NoError(t, err)
		return len(es)
	}
	before := count()
	for i := range 200 {
		var got []string
		p, err := Start("sh", []string{"-c", "echo a; echo b >&2; printf last"}, Options{
			OnLine: func(l string) { got = append(got, l) },
		})
		require.NoError(t, err)
		require.NoError(t, p.Wait(30*time.Second))
		require.Equal(t, []string{"a", "last"}, got, "run %d", i)
	}
	assert.LessOrEqual(t, count(), before)
}

package main

// Helper processes for the operators' tools tests: this test binary
// re-executed (see asMainEnv) runs the hidden command test-proc, which is
// registered only in the test binary.

import (
	"bufio"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

func init() {
	register(&command{name: "test-proc", hidden: true, summary: "test helper process", run: runTestProc})
}

// runTestProc: test-proc producer NAME SLOTS RATE | test-proc reader NAME.
// The producer publishes test batches at RATE per second (0: as fast as
// the readers allow; negative: none) until killed; the reader reads and releases until
// the stream ends. Both print "ready" once set up.
func runTestProc(e *env, args []string) int {
	if len(args) < 2 {
		fmt.Fprintln(e.stderr, "usage: test-proc producer NAME SLOTS RATE | test-proc reader NAME")
		return exitUsage
	}
	switch args[0] {
	case "producer":
		slots, _ := strconv.Atoi(args[2])
		rate, _ := strconv.Atoi(args[3])
		p, err := producer.Create(args[1], producer.Options{Slots: uint32(slots), SlotBytes: batchgen.MaxPayload, MaxReaders: 8})
		if err != nil {
			fmt.Fprintln(e.stdout, "error:", err)
			return exitFail
		}
		fmt.Fprintln(e.stdout, "ready")
		if rate < 0 {
			select {} // idle until killed
		}
		var tick <-chan time.Time
		if rate > 0 {
			tk := time.NewTicker(time.Second / time.Duration(rate))
			defer tk.Stop()
			tick = tk.C
		}
		for i := uint64(0); ; {
			if tick != nil {
				<-tick
			}
			buf, err := p.Reserve(batchgen.PayloadBytes(i), 100*time.Millisecond)
			if errors.Is(err, producer.ErrTimedOut) {
				continue
			}
			if err != nil {
				fmt.Fprintln(e.stdout, "error:", err)
				return exitFail
			}
			ts, meta := batchgen.Write(buf, i)
			if err := p.Publish(ts, meta); err != nil {
				fmt.Fprintln(e.stdout, "error:", err)
				return exitFail
			}
			i++
		}
	case "reader":
		r, err := reader.Attach(args[1], reader.Options{Start: reader.StartNow, AttachTimeout: 10 * time.Second})
		if err != nil {
			fmt.Fprintln(e.stdout, "error:", err)
			return exitFail
		}
		fmt.Fprintln(e.stdout, "ready")
		for {
			b, err := r.Acquire(time.Second)
			if err != nil {
				fmt.Fprintln(e.stdout, "end:", err)
				r.Detach()
				return exitOK
			}
			if b != nil {
				r.Release(b)
			}
		}
	}
	return exitUsage
}

// child is a helper process.
type child struct {
	cmd  *exec.Cmd
	done chan struct{}
	mu   sync.Mutex
	out  []string
}

// startChild runs test-proc with args and waits for its "ready" line. It
// is killed when the test ends.
func startChild(t *testing.T, args ...string) *child {
	t.Helper()
	c := &child{done: make(chan struct{})}
	c.cmd = exec.Command(os.Args[0], append([]string{"test-proc"}, args...)...)
	c.cmd.Env = append(os.Environ(), asMainEnv+"=1")
	c.cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	c.cmd.Stderr = os.Stderr
	out, err := c.cmd.StdoutPipe()
	require.NoError(t, err)
	require.NoError(t, c.cmd.Start())
	ready := make(chan string, 1)
	var once atomic.Bool
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			c.mu.Lock()
			c.out = append(c.out, sc.Text())
			c.mu.Unlock()
			if once.CompareAndSwap(false, true) {
				ready <- sc.Text()
			}
		}
		io.Copy(io.Discard, out)
		c.cmd.Wait()
		close(c.done)
	}()
	t.Cleanup(func() { c.kill() })
	select {
	case l := <-ready:
		require.Equal(t, "ready", l, "test-proc %v", args)
	case <-c.done:
		t.Fatalf("test-proc %v exited before it was ready", args)
	case <-time.After(20 * time.Second):
		t.Fatalf("test-proc %v not ready after 20 s", args)
	}
	return c
}

// kill SIGKILLs the child and waits for it.
func (c *child) kill() {
	select {
	case <-c.done:
		return
	default:
	}
	c.cmd.Process.Kill()
	<-c.done
}

// pid is the child's process id.
func (c *child) pid() int { return c.cmd.Process.Pid }

// chanName is a channel name unique to this test run, removed at the end.
func chanName(t *testing.T, tag string) string {
	t.Helper()
	name := fmt.Sprintf("clitest-%d-%s-%d", os.Getpid(), tag, time.Now().UnixNano()%1e6)
	require.True(t, ring.NameOK(name), name)
	t.Cleanup(func() { os.Remove(ring.ChannelPath(name)) })
	return name
}

// deadChannel makes a channel whose producer process was SIGKILLed.
func deadChannel(t *testing.T, tag string) string {
	t.Helper()
	name := chanName(t, tag)
	c := startChild(t, "producer", name, "4", "0")
	c.kill()
	return name
}

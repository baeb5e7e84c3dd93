package main

// Helper processes for the operators' tools tests: this test binary
// re-executed (see asMainEnv) runs the hidden command test-proc, which is
// registered only in the test binary.

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/childproc"
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
type child struct{ *childproc.Process }

// startChild runs test-proc with args and waits for its "ready" line. It
// is killed when the test ends.
func startChild(t *testing.T, args ...string) *child {
	t.Helper()
	ready := make(chan string, 1)
	var once atomic.Bool
	p, err := childproc.Start(os.Args[0], append([]string{"test-proc"}, args...), childproc.Options{
		Env:    []string{asMainEnv + "=1"},
		Stderr: os.Stderr,
		OnLine: func(l string) {
			if once.CompareAndSwap(false, true) {
				ready <- l
			}
		},
	})
	require.NoError(t, err)
	t.Cleanup(p.Kill)
	select {
	case l := <-ready:
		require.Equal(t, "ready", l, "test-proc %v", args)
	case <-p.Done():
		t.Fatalf("test-proc %v exited before it was ready", args)
	case <-time.After(20 * time.Second):
		t.Fatalf("test-proc %v not ready after 20 s", args)
	}
	return &child{p}
}

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
	c.Kill()
	return name
}

package main

// The soak's child processes: the producer and the Go reader (the C reader
// is creader/soak_reader.c; both print the same lines).

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// incShift places the producer incarnation in the batch counter: the
// producer of incarnation K publishes data batches K<<incShift + 0, 1, ...
const incShift = 40

// runProducerRole: producer --name N --slots S --rate R --inc K --epoch-every E.
// Prints "created ns=<how long Create took>", then publishes until told
// otherwise on stdin: "pause", "drain N" (publish N batches, waiting up to
// 10 s for each; answers "drained ok" or "drained error: ..."), "close"
// (closes the channel and exits). Its twin on libtsock.so, which can also
// fork, is cproducer/soak_producer.c.
func runProducerRole(args []string) int {
	fs := flag.NewFlagSet("soak producer", flag.ContinueOnError)
	name := fs.String("name", "", "channel")
	slots := fs.Uint("slots", 16, "ring depth")
	rate := fs.Int("rate", 2000, "batches per second (0: unthrottled)")
	inc := fs.Uint64("inc", 0, "incarnation")
	every := fs.Uint64("epoch-every", 500, "batches per epoch")
	device := fs.String("device", "", "device pool (cuda:N)")
	if fs.Parse(args) != nil {
		return 2
	}
	t0 := time.Now()
	p, err := producer.Create(*name, producer.Options{Slots: uint32(*slots), SlotBytes: batchgen.MaxPayload,
		MaxReaders: 32, Device: *device})
	if err != nil {
		fmt.Printf("error create: %v\n", err)
		return 1
	}
	fmt.Printf("created ns=%d\n", time.Since(t0).Nanoseconds())
	cmds := make(chan string, 8)
	go func() {
		sc := bufio.NewScanner(os.Stdin)
		for sc.Scan() {
			cmds <- sc.Text()
		}
		close(cmds)
	}()
	var tick <-chan time.Time
	if *rate > 0 {
		t := time.NewTicker(time.Second / time.Duration(*rate))
		defer t.Stop()
		tick = t.C
	}
	base := *inc << incShift
	i := base
	one := func(timeout time.Duration) error {
		buf, err := p.Reserve(batchgen.PayloadBytes(i), timeout)
		if err != nil {
			return err
		}
		ts, meta := batchgen.Write(buf, i)
		if err := p.Publish(ts, meta); err != nil {
			return err
		}
		i++
		if *every > 0 && (i-base)%*every == 0 {
			for {
				err := p.EndEpoch(timeout)
				if err == nil {
					break
				}
				if !errors.Is(err, producer.ErrTimedOut) {
					return err
				}
			}
		}
		return nil
	}
	paused := false
	for {
		var cmd string
		var ok bool
		if paused {
			cmd, ok = <-cmds
		} else {
			select {
			case cmd, ok = <-cmds:
			default:
				ok, cmd = true, ""
			}
		}
		if !ok { // stdin closed: the orchestrator is gone
			return 1
		}
		switch f := strings.Fields(cmd); {
		case len(f) == 0:
		case f[0] == "pause":
			paused = true
			fmt.Println("paused")
			continue
		case f[0] == "drain" && len(f) == 2:
			n, _ := strconv.Atoi(f[1])
			var err error
			for k := 0; k < n && err == nil; k++ {
				err = one(10 * time.Second)
			}
			if err != nil {
				fmt.Printf("drained error: %v\n", err)
			} else {
				fmt.Println("drained ok")
			}
			continue
		case f[0] == "close":
			if err := p.Close(); err != nil {
				fmt.Printf("error close: %v\n", err)
				return 1
			}
			fmt.Println("closed")
			return 0
		}
		if paused {
			continue
		}
		if tick != nil {
			<-tick
		}
		if err := one(100 * time.Millisecond); err != nil && !errors.Is(err, producer.ErrTimedOut) {
			fmt.Printf("error publish: %v\n", err)
			return 1
		}
	}
}

// runReaderRole: reader NAME SLOW_US. The Go twin of creader/soak_reader.c.
func runReaderRole(args []string) int {
	if len(args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: reader NAME SLOW_US")
		return 2
	}
	name := args[0]
	slowUs, _ := strconv.Atoi(args[1])
	slow := time.Duration(slowUs) * time.Microsecond
	term := make(chan os.Signal, 1)
	signal.Notify(term, syscall.SIGTERM)
	var n uint64
	lastProgress := time.Time{}
	prevInc := int64(-1)
	ts := make([]batchgen.Tensor, 0, 2)
	for {
		r, err := reader.Attach(name, reader.Options{Start: reader.StartNow, AttachTimeout: 30 * time.Second})
		if err != nil {
			fmt.Printf("error attach: %v\n", err)
			return 1
		}
		fmt.Println("attached")
		haveSeq, haveI := false, false
		var lastSeq, lastI uint64
		var goneAt time.Duration
		drainedAt := monoNow()
		for {
			select {
			case <-term:
				r.Detach()
				fmt.Printf("detached n=%d\n", n)
				return 0
			default:
			}
			if time.Since(lastProgress) >= 250*time.Millisecond {
				lastProgress = time.Now()
				fmt.Printf("progress n=%d\n", n)
			}
			b, err := r.Acquire(100 * time.Millisecond)
			if errors.Is(err, reader.ErrProducerGone) {
				goneAt = monoNow()
				break
			}
			if errors.Is(err, reader.ErrClosed) {
				r.Detach()
				fmt.Printf("closed n=%d\n", n)
				return 0
			}
			if err != nil {
				fmt.Printf("error acquire: %v\n", err)
				return 1
			}
			if b == nil {
				continue
			}
			if haveSeq && b.Seq != lastSeq+1 {
				return mismatch(b.Seq, fmt.Sprintf("seq %d follows seq %d", b.Seq, lastSeq))
			}
			haveSeq, lastSeq = true, b.Seq
			if b.EpochEnd() {
				if len(b.Tensors) != 0 {
					return mismatch(b.Seq, "epoch-end marker with tensors")
				}
			} else {
				ts = ts[:0]
				for _, x := range b.Tensors {
					ts = append(ts, batchgen.Tensor(x))
				}
				i, _, err := batchgen.Check(ts, b.Meta)
				if err != nil {
					return mismatch(b.Seq, err.Error())
				}
				if haveI && i != lastI+1 {
					return mismatch(b.Seq, fmt.Sprintf("i=%d follows i=%d", i, lastI))
				}
				if !haveI && prevInc >= 0 && int64(i>>incShift) <= prevInc {
					return mismatch(b.Seq, fmt.Sprintf("attached to incarnation %d after incarnation %d", i>>incShift, prevInc))
				}
				haveI, lastI = true, i
				n++
			}
			if slow > 0 {
				time.Sleep(slow)
			}
			if err := r.Release(b); err != nil {
				fmt.Printf("error release: %v\n", err)
				return 1
			}
			drainedAt = monoNow()
		}
		inc, seq := int64(-1), int64(-1)
		if haveI {
			inc = int64(lastI >> incShift)
			prevInc = inc
		}
		if haveSeq {
			seq = int64(lastSeq)
		}
		fmt.Printf("gone inc=%d last_seq=%d mono=%d drained=%d\n", inc, seq, goneAt.Nanoseconds(), drainedAt.Nanoseconds())
		r.Detach()
	}
}

func mismatch(seq uint64, what string) int {
	fmt.Printf("MISMATCH batch seq=%d: %s\n", seq, what)
	return 2
}

// statusOf is a short name of an error's tsock status, for messages.
func statusOf(err error) string { return ring.Status(ring.StatusOf(err)).Error() }

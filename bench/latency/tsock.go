package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"time"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// tsockLatency runs one configuration: a paced producer here, `readers`
// reader processes in `mode`. It returns the pooled one-way latencies and
// the achieved publish interval.
func tsockLatency(cfg config, mode string, readers int) (stats, time.Duration, error) {
	runtime.LockOSThread() // for Pdeathsig and the pacer's timer slack
	defer runtime.UnlockOSThread()
	name := fmt.Sprintf("tsock-latency-%d-%s-%d", os.Getpid(), mode, readers)
	total := cfg.samples + cfg.warmup
	p, err := producer.Create(name, producer.Options{
		// Deep enough that a reader descheduled for a few ms does not
		// hold the producer back: its latency then shows, unblurred.
		Slots:      1024,
		SlotBytes:  cfg.payload,
		MaxReaders: uint32(max(readers, producer.DefaultMaxReaders)),
	})
	if err != nil {
		return stats{}, 0, err
	}
	defer p.Close()

	children := make([]*child, 0, readers)
	defer func() {
		for _, c := range children {
			c.Kill()
		}
	}()
	for i := 0; i < readers; i++ {
		var c *child
		var err error
		if cfg.helper != "" { // a C reader process: no Go runtime, no allocation per batch
			c, err = startProgram(cfg.helper, "tsock", name, mode, strconv.Itoa(cfg.warmup), "0")
		} else {
			c, err = startChild("reader", name, mode, strconv.Itoa(cfg.warmup), strconv.Itoa(total))
		}
		if err != nil {
			return stats{}, 0, err
		}
		children = append(children, c)
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		err := p.WaitReaders(readers, 20*time.Millisecond)
		if err == nil {
			break
		}
		for _, c := range children {
			if c.Exited() {
				return stats{}, 0, fmt.Errorf("reader %d exited before attaching: %v", c.Pid(), c.Err())
			}
		}
		if time.Now().After(deadline) {
			return stats{}, 0, fmt.Errorf("readers did not attach: %v", err)
		}
	}

	tensors := []producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{int64(cfg.payload)}}}
	pace := newPacer(cfg.intervalFor(readers), cfg.paceSpin)
	t0 := now()
	stop := t0 + uint64(cfg.maxTime)
	published := 0
	for published < total {
		pace.wait()
		buf, err := p.Reserve(cfg.payload, time.Second)
		if err != nil {
			return stats{}, 0, fmt.Errorf("reserve: %w", err)
		}
		binary.LittleEndian.PutUint64(buf, uint64(published))
		if err := p.Publish(tensors, nil); err != nil {
			return stats{}, 0, fmt.Errorf("publish: %w", err)
		}
		published++
		if now() > stop {
			break
		}
	}
	interval := time.Duration((now() - t0) / uint64(published))
	if err := p.Close(); err != nil {
		return stats{}, 0, err
	}

	var pooled []uint64
	var missed uint64
	for _, c := range children {
		v, err := c.finish(10 * time.Second)
		if err != nil {
			return stats{}, 0, err
		}
		samples, cnt := splitCounters(v)
		pooled = append(pooled, samples...)
		// Each reader must have seen every batch.
		if cnt.extra < uint64(published) {
			missed += uint64(published) - cnt.extra
		}
	}
	st := summarize(pooled)
	st.missed = int(missed)
	return st, interval, nil
}

// tsockReaderChild attaches to the channel and records now - PublishNs for
// every batch until the producer closes it.
func tsockReaderChild(args []string) error {
	args, err := checkParent(args)
	if err != nil {
		return err
	}
	if len(args) != 4 {
		return errors.New("usage: reader NAME MODE WARMUP TOTAL")
	}
	name, mode := args[0], args[1]
	warmup, _ := strconv.Atoi(args[2])
	total, _ := strconv.Atoi(args[3])
	opts := reader.Options{AttachTimeout: 10 * time.Second, MaxHeld: 1, Start: reader.StartNow}
	switch mode {
	case "spin":
		opts.Spin = time.Second
	case "futex":
		opts.Spin = -1
	default:
		return fmt.Errorf("unknown mode %q", mode)
	}
	r, err := reader.Attach(name, opts)
	if err != nil {
		return err
	}
	defer r.Detach()
	samples := make([]uint64, 0, total)
	var missed, seen uint64
	next := uint64(0)
	for {
		b, err := r.Acquire(30 * time.Second)
		t := now()
		if errors.Is(err, reader.ErrClosed) {
			break
		}
		if err != nil {
			return err
		}
		if b == nil {
			return errors.New("no batch within 30 s")
		}
		// Touch the payload, as a consumer would, and check the sequence.
		if v := binary.LittleEndian.Uint64(b.Tensors[0].Data); v != b.Seq {
			return fmt.Errorf("batch %d carries %d", b.Seq, v)
		}
		if b.Seq != next {
			missed += b.Seq - next
		}
		next = b.Seq + 1
		seen++
		if b.Seq >= uint64(warmup) && t >= b.PublishNs {
			samples = append(samples, t-b.PublishNs)
		}
		if err := r.Release(b); err != nil {
			return err
		}
	}
	return writeSamples(samples, missed, seen)
}

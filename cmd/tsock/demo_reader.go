package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"os"
	"strings"
	"time"

	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

func init() {
	register(&command{
		name:    "demo-reader",
		args:    "NAME",
		summary: "reader process of 'tsock demo' (internal)",
		hidden:  true,
		run:     runDemoReader,
	})
}

// demoReport is what a demo reader prints on stdout, as one JSON line.
type demoReport struct {
	Pid         int     `json:"pid"`
	Batches     uint64  `json:"batches"` // data batches, epoch markers excluded
	Epochs      uint64  `json:"epochs"`  // epoch-end markers seen
	Bytes       uint64  `json:"bytes"`   // tensor bytes verified
	Seconds     float64 `json:"seconds"` // first batch published -> last batch verified
	WaitSeconds float64 `json:"wait_seconds"`
	ChecksumOK  uint64  `json:"checksum_ok"`
	ChecksumBad uint64  `json:"checksum_bad"`
	FirstBad    string  `json:"first_bad,omitempty"`
	OrderErrors uint64  `json:"order_errors"`
	End         string  `json:"end"`             // how the stream ended
	Error       string  `json:"error,omitempty"` // set when the reader gave up
}

// demoReaderConfig is the command line of a demo reader.
type demoReaderConfig struct {
	name       string
	parent     int
	batches    int
	epochs     int
	batchBytes uint64
	spin       time.Duration
	timeout    time.Duration
}

// runDemoReader is the entry point of `tsock demo-reader NAME [flags]`.
func runDemoReader(e *env, args []string) int {
	var cfg demoReaderConfig
	if len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		cfg.name, args = args[0], args[1:]
	}
	fs := newFlagSet("demo-reader", e.stderr)
	fs.IntVar(&cfg.parent, "parent", 0, "pid of the demo process; exit if it is gone")
	fs.IntVar(&cfg.batches, "batches", 0, "batches per epoch to expect")
	fs.IntVar(&cfg.epochs, "epochs", 0, "epochs to expect")
	fs.Uint64Var(&cfg.batchBytes, "batch-bytes", 0, "batch size the producer uses")
	fs.DurationVar(&cfg.spin, "spin", 20*time.Microsecond, "busy-poll before sleeping (negative: never)")
	fs.DurationVar(&cfg.timeout, "timeout", 30*time.Second, "longest wait for the channel or a batch")
	if st, ok := parseFlags(fs, args); !ok {
		return st
	}
	if cfg.name == "" || fs.NArg() != 0 {
		fmt.Fprintf(e.stderr, "usage: tsock demo-reader NAME [flags]\n")
		return exitUsage
	}
	// Pdeathsig only covers a parent that dies after the fork; this covers
	// one that died before.
	if cfg.parent != 0 && os.Getppid() != cfg.parent {
		fmt.Fprintf(e.stderr, "tsock demo-reader: parent %d is gone\n", cfg.parent)
		return exitFail
	}
	rep := readDemo(cfg)
	if err := json.NewEncoder(e.stdout).Encode(rep); err != nil {
		return exitFail
	}
	if rep.Error != "" || rep.ChecksumBad > 0 || rep.OrderErrors > 0 {
		return exitFail
	}
	return exitOK
}

// readDemo attaches, reads and verifies the whole stream.
func readDemo(cfg demoReaderConfig) (rep demoReport) {
	rep.Pid = os.Getpid()
	layout, err := newDemoLayout(cfg.batchBytes)
	if err != nil {
		rep.Error = err.Error()
		return rep
	}
	r, err := reader.Attach(cfg.name, reader.Options{AttachTimeout: cfg.timeout, Spin: cfg.spin})
	if err != nil {
		rep.Error = fmt.Sprintf("attach %q: %v", cfg.name, err)
		return rep
	}
	defer r.Detach()

	var first, last, waitNs uint64
	var epoch, index uint64 // what the next batch should be
	for {
		t0 := ring.MonotonicNs()
		b, err := r.Acquire(cfg.timeout)
		if err != nil {
			switch {
			case errors.Is(err, reader.ErrClosed):
				rep.End = "closed"
			case errors.Is(err, reader.ErrProducerGone):
				rep.End = "producer gone"
			default:
				rep.Error = fmt.Sprintf("acquire: %v", err)
			}
			break
		}
		if b == nil {
			rep.Error = fmt.Sprintf("no batch within %v (after %d batches)", cfg.timeout, rep.Batches)
			break
		}
		if first == 0 {
			first = b.PublishNs
		} else {
			waitNs += ring.MonotonicNs() - t0
		}
		if b.Epoch != epoch || b.Index != index {
			rep.OrderErrors++
		}
		if b.EpochEnd() {
			rep.Epochs++
			epoch, index = b.Epoch+1, 0
		} else {
			if problem := verifyDemoBatch(layout, b); problem != "" {
				rep.ChecksumBad++
				if rep.FirstBad == "" {
					rep.FirstBad = fmt.Sprintf("batch %d of epoch %d: %s", b.Index, b.Epoch, problem)
				}
			} else {
				rep.ChecksumOK++
			}
			rep.Batches++
			for _, t := range b.Tensors {
				rep.Bytes += uint64(len(t.Data))
			}
			epoch, index = b.Epoch, b.Index+1
			last = ring.MonotonicNs()
		}
		if err := r.Release(b); err != nil {
			rep.Error = fmt.Sprintf("release: %v", err)
			break
		}
	}
	if last > first {
		rep.Seconds = float64(last-first) / 1e9
	}
	rep.WaitSeconds = float64(waitNs) / 1e9
	return rep
}

// verifyDemoBatch checks a batch's tensors against the layout and its
// metadata; it returns "" or what is wrong.
func verifyDemoBatch(l demoLayout, b *reader.Batch) string {
	if len(b.Tensors) != 2 {
		return fmt.Sprintf("%d tensors, want 2", len(b.Tensors))
	}
	f, lab := &b.Tensors[0], &b.Tensors[1]
	if f.Dtype != ring.DtypeFloat32 || len(f.Shape) != 2 || f.Shape[0] != int64(l.rows) || f.Shape[1] != int64(l.cols) ||
		uint64(len(f.Data)) != l.featBytes {
		return fmt.Sprintf("features are dtype %d shape %v, want float32 [%d %d]", f.Dtype, f.Shape, l.rows, l.cols)
	}
	if lab.Dtype != ring.DtypeInt64 || len(lab.Shape) != 1 || lab.Shape[0] != int64(l.rows) ||
		uint64(len(lab.Data)) != l.labelBytes {
		return fmt.Sprintf("labels are dtype %d shape %v, want int64 [%d]", lab.Dtype, lab.Shape, l.rows)
	}
	m, err := parseDemoMeta(b.Meta)
	if err != nil {
		return err.Error()
	}
	if m.epoch != b.Epoch || m.index != b.Index {
		return fmt.Sprintf("metadata names batch %d of epoch %d", m.index, m.epoch)
	}
	if got := crc32.Checksum(f.Data, castagnoli); got != m.featCRC {
		return fmt.Sprintf("feature CRC %08x, metadata says %08x", got, m.featCRC)
	}
	if got := crc32.Checksum(lab.Data, castagnoli); got != m.labelCRC {
		return fmt.Sprintf("label CRC %08x, metadata says %08x", got, m.labelCRC)
	}
	return ""
}

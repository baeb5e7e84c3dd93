package main

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"runtime"
	"sort"
	"strconv"
	"syscall"
	"time"

	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
	"golang.org/x/sys/unix"
)

// scaleRow is the producer's cost per publish with n sleeping readers.
type scaleRow struct {
	Readers    int     `json:"readers"`
	Publishes  int     `json:"publishes"`
	CPUMedian  float64 `json:"cpu_us_median"` // producer thread CPU per reserve + publish, µs
	CPUMean    float64 `json:"cpu_us_mean"`
	WallMedian float64 `json:"wall_us_median"`
	Interval   float64 `json:"interval_us"`
	Err        string  `json:"error,omitempty"`
}

func threadCPU() uint64 {
	var ts unix.Timespec
	_ = unix.ClockGettime(unix.CLOCK_THREAD_CPUTIME_ID, &ts)
	return uint64(ts.Nano())
}

// producerCost publishes cfg.scalePublishes paced 4 KiB batches to n C
// readers that sleep on the futex between batches (so every publish wakes
// them all), and times each reserve + publish in the producer thread's CPU
// clock. n = 0 is the floor: the same calls with nobody to wake.
func producerCost(cfg config, n int) scaleRow {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	row := scaleRow{Readers: n}
	fail := func(err error) scaleRow { row.Err = err.Error(); return row }
	name := fmt.Sprintf("tsock-scale-%d-%d", os.Getpid(), n)
	const bytes = 4096
	p, err := producer.Create(name, producer.Options{Slots: 16, SlotBytes: bytes})
	if err != nil {
		return fail(err)
	}
	defer p.Close()
	var readers []*child
	if n > 0 {
		if readers, err = attachReaders(cfg, p, "tsock", name, n, "futex", "-1", "0"); err != nil {
			return fail(err)
		}
	}
	defer killAll(readers)
	iv := max(200*time.Microsecond, cfg.intervalFor(n))
	row.Interval = float64(iv) / 1e3
	tensors := []producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{bytes}}}
	pace := newPacer(iv, false)
	var cpu, wall []float64
	for i := 0; i < cfg.scalePublishes+cfg.scalePublishes/10; i++ {
		pace.wait()
		c0, w0 := threadCPU(), now()
		buf, err := p.Reserve(bytes, 10*time.Second)
		if err != nil {
			return fail(err)
		}
		binary.LittleEndian.PutUint64(buf, uint64(i))
		if err := p.Publish(tensors, nil); err != nil {
			return fail(err)
		}
		c1, w1 := threadCPU(), now()
		if i >= cfg.scalePublishes/10 { // warm-up dropped
			cpu = append(cpu, float64(c1-c0)/1e3)
			wall = append(wall, float64(w1-w0)/1e3)
		}
	}
	if err := p.Close(); err != nil {
		return fail(err)
	}
	if _, _, err := finishAll(readers, 30*time.Second); err != nil {
		return fail(err)
	}
	sum := 0.0
	for _, v := range cpu {
		sum += v
	}
	row.Publishes = len(cpu)
	row.CPUMedian, row.CPUMean, row.WallMedian = median(cpu), sum/float64(len(cpu)), median(wall)
	return row
}

// shmRow is the shared memory of one geometry: computed by layout.h's
// rules, the file's size, and the memory it holds after one lap of the ring.
type shmRow struct {
	Slots     uint32 `json:"slots"`
	SlotBytes uint64 `json:"slot_bytes"`
	Readers   uint32 `json:"max_readers"`
	Computed  uint64 `json:"computed_bytes"`
	FileSize  uint64 `json:"file_bytes"`
	Allocated uint64 `json:"allocated_bytes"` // st_blocks after every slot was written once
	Payload   uint64 `json:"payload_bytes"`   // slots x slot bytes
	Err       string `json:"error,omitempty"`
}

func shmSize(slots uint32, bytes uint64) shmRow {
	row := shmRow{Slots: slots, SlotBytes: bytes, Readers: producer.DefaultMaxReaders, Payload: uint64(slots) * bytes}
	g, ok := ring.ComputeGeometry(slots, producer.DefaultMaxReaders, bytes)
	if !ok {
		row.Err = "geometry out of range"
		return row
	}
	row.Computed = g.TotalBytes
	name := fmt.Sprintf("tsock-shm-%d-%d-%d", os.Getpid(), slots, bytes)
	p, err := producer.Create(name, producer.Options{Slots: slots, SlotBytes: bytes})
	if err != nil {
		row.Err = err.Error()
		return row
	}
	defer p.Close()
	tensors := []producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{int64(bytes)}}}
	for i := uint32(0); i < slots; i++ {
		buf, err := p.Reserve(bytes, time.Second)
		if err == nil {
			for j := range buf {
				buf[j] = 1 // a full batch: every page written
			}
			err = p.Publish(tensors, nil)
		}
		if err != nil {
			row.Err = err.Error()
			return row
		}
	}
	var st syscall.Stat_t
	if err := syscall.Stat(ring.ChannelPath(name), &st); err != nil {
		row.Err = err.Error()
		return row
	}
	row.FileSize, row.Allocated = uint64(st.Size), uint64(st.Blocks)*512
	return row
}

// costRow is a reader's acquire + release of a batch already published.
type costRow struct {
	Bytes    uint64    `json:"bytes"`
	Samples  int       `json:"samples"`
	MedianNs float64   `json:"median_ns"`
	MeanNs   float64   `json:"mean90_ns"` // mean of the samples up to the 90th percentile (the clock ticks in 10 ns here)
	P99Ns    float64   `json:"p99_ns"`
	Repeats  []float64 `json:"repeat_mean90_ns"`
	Err      string    `json:"error,omitempty"`
}

// medianCost is the repeat with the median mean90, and every repeat's value.
func medianCost(runs []costRow) costRow {
	var ok []costRow
	var vals []float64
	for _, r := range runs {
		if r.Err != "" {
			return r
		}
		ok = append(ok, r)
		vals = append(vals, r.MeanNs)
	}
	sort.Slice(ok, func(i, j int) bool { return ok[i].MeanNs < ok[j].MeanNs })
	m := ok[len(ok)/2]
	m.Repeats = vals
	return m
}

// readCost times a C reader's acquire + release of batches of `bytes` that
// are ready when it asks (helper role tsock-cost). The producer never
// blocks (timeout 0, then a nap), so no release has a producer to wake.
func readCost(cfg config, bytes uint64) costRow {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	row := costRow{Bytes: bytes}
	fail := func(err error) costRow { row.Err = err.Error(); return row }
	name := fmt.Sprintf("tsock-cost-%d-%d", os.Getpid(), bytes)
	p, err := producer.Create(name, producer.Options{Slots: 16, SlotBytes: bytes})
	if err != nil {
		return fail(err)
	}
	defer p.Close()
	rounds := 400
	if cfg.quick {
		rounds = 100
	}
	readers, err := attachReaders(cfg, p, "tsock-cost", name, 1, strconv.Itoa(rounds))
	if err != nil {
		return fail(err)
	}
	defer killAll(readers)
	tensors := []producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{int64(bytes)}}}
	for seq := uint64(0); !readers[0].Exited(); {
		buf, err := p.Reserve(bytes, 0)
		if errors.Is(err, producer.ErrBackpressure) {
			time.Sleep(200 * time.Microsecond)
			continue
		}
		if err != nil {
			return fail(err)
		}
		binary.LittleEndian.PutUint64(buf, seq)
		if err := p.Publish(tensors, nil); err != nil {
			return fail(err)
		}
		seq++
	}
	v, err := readers[0].finish(10 * time.Second)
	if err != nil {
		return fail(err)
	}
	samples, _ := splitCounters(v)
	if len(samples) == 0 {
		return fail(errors.New("the reader timed no batch"))
	}
	st := summarize(samples) // sorts
	keep := samples[:max(1, len(samples)*9/10)]
	sum := 0.0
	for _, x := range keep {
		sum += float64(x)
	}
	row.Samples, row.MedianNs, row.P99Ns, row.MeanNs = st.n, st.median*1e3, st.p99*1e3, sum/float64(len(keep))
	return row
}

// flatRow is the producer publishing flat out to n readers (tsock's default
// wait: spin 20 µs, then the futex): on 2 CPUs the ring is full most of the
// time, so this is the cost of back-pressure (waiting, being woken, checking
// the readers) per publish.
type flatRow struct {
	Readers        int     `json:"readers"`
	PublishesPerS  float64 `json:"publishes_per_s"`
	CPUPerPublish  float64 `json:"cpu_us_per_publish"` // producer thread CPU over the run / publishes
	BackpressureUs float64 `json:"backpressure_us_per_publish"`
	Err            string  `json:"error,omitempty"`
}

func producerFlat(cfg config, n int) flatRow {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	row := flatRow{Readers: n}
	fail := func(err error) flatRow { row.Err = err.Error(); return row }
	name := fmt.Sprintf("tsock-flat-%d-%d", os.Getpid(), n)
	const bytes = 4096
	p, err := producer.Create(name, producer.Options{Slots: 16, SlotBytes: bytes})
	if err != nil {
		return fail(err)
	}
	defer p.Close()
	readers, err := attachReaders(cfg, p, "tsock", name, n, "default", "-1", "0")
	if err != nil {
		return fail(err)
	}
	defer killAll(readers)
	tensors := []producer.Tensor{{Dtype: ring.DtypeUint8, Shape: []int64{bytes}}}
	c0, t0 := threadCPU(), now()
	pubs := 0
	for now()-t0 < uint64(cfg.tputTime) {
		buf, err := p.Reserve(bytes, 10*time.Second)
		if err != nil {
			return fail(err)
		}
		binary.LittleEndian.PutUint64(buf, uint64(pubs))
		if err := p.Publish(tensors, nil); err != nil {
			return fail(err)
		}
		pubs++
	}
	c1, t1 := threadCPU(), now()
	bp := p.Stats().BackpressureNs
	if err := p.Close(); err != nil {
		return fail(err)
	}
	if _, _, err := finishAll(readers, 30*time.Second); err != nil {
		return fail(err)
	}
	row.PublishesPerS = float64(pubs) / (float64(t1-t0) / 1e9)
	row.CPUPerPublish = float64(c1-c0) / 1e3 / float64(pubs)
	row.BackpressureUs = float64(bp) / 1e3 / float64(pubs)
	return row
}

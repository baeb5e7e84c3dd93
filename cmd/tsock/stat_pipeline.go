package main

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"sort"
	"strings"
	"syscall"
)

// The producer's pipeline figures (stage times, worker pool, decoded-sample
// cache) live in its Python process, not in the segment: a tsock.Producer
// fed by a tsock.Pipeline writes them at most once a second to
// /dev/shm/.tsock-stats.NAME (python/tsock/_stats_note.py). They are
// untrusted input: only a regular file of the segment's owner, at most
// statsNoteMax bytes, naming the channel's producer pid, with sane values,
// is used; anything else is no figures.
const (
	statsNotePrefix = ".tsock-stats."
	statsNoteMax    = 64 << 10
	statsStagesMax  = 16
)

// stageOrder is the order a Pipeline runs its stages in; others follow.
var stageOrder = []string{"source", "read", "decode", "augment", "collate"}

// pipelineNote is what the producer wrote.
type pipelineNote struct {
	Pid       int                `json:"pid"`
	Workers   int                `json:"workers"`
	IOThreads int                `json:"io_threads"`
	StageS    map[string]float64 `json:"stage_s"`
	Cache     *struct {
		Hits   uint64 `json:"hits"`
		Misses uint64 `json:"misses"`
		Bytes  uint64 `json:"bytes"`
	} `json:"cache"`
}

// pipelineSample is an interval's figures of the producer's pipeline.
type pipelineSample struct {
	Workers   int `json:"workers"`
	IOThreads int `json:"io_threads,omitempty"`
	// Seconds spent in each stage per second of the interval, its workers
	// summed: 1.9 for decode is about two workers decoding all the time.
	StageBusy    map[string]float64 `json:"stage_busy"`
	CacheHitRate *float64           `json:"cache_hit_rate,omitempty"` // over the interval; nil: no lookup in it
	CacheBytes   *uint64            `json:"cache_bytes,omitempty"`
}

// readPipelineNote returns the figures of channel name written by the
// producer pid, or nil.
func readPipelineNote(name string, owner uint32, pid int) *pipelineNote {
	f, err := os.OpenFile(shmDir+"/"+statsNotePrefix+name, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil
	}
	defer f.Close()
	var st syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &st) != nil || st.Mode&syscall.S_IFMT != syscall.S_IFREG ||
		st.Uid != owner || st.Size > statsNoteMax {
		return nil
	}
	b, err := io.ReadAll(io.LimitReader(f, statsNoteMax+1))
	var n pipelineNote
	if err != nil || len(b) > statsNoteMax || json.Unmarshal(b, &n) != nil || n.Pid != pid || pid <= 0 {
		return nil
	}
	if n.Workers < 0 || n.Workers > 1<<16 || n.IOThreads < 0 || n.IOThreads > 1<<16 || len(n.StageS) > statsStagesMax {
		return nil
	}
	for k, v := range n.StageS {
		if !plainName(k) || math.IsNaN(v) || math.IsInf(v, 0) || v < 0 {
			return nil
		}
	}
	return &n
}

// pipelineBetween computes an interval's figures from two notes of one
// producer; nil without both.
func pipelineBetween(a, b *pipelineNote, seconds float64) *pipelineSample {
	if a == nil || b == nil || a.Pid != b.Pid || seconds <= 0 {
		return nil
	}
	s := &pipelineSample{Workers: b.Workers, IOThreads: b.IOThreads, StageBusy: map[string]float64{}}
	for k, v := range b.StageS {
		busy := math.Max(0, v-a.StageS[k]) / seconds
		if math.IsInf(busy, 0) || math.IsNaN(busy) {
			continue // huge untrusted values over a tiny interval: JSON has no Inf
		}
		s.StageBusy[k] = busy
	}
	if b.Cache != nil {
		s.CacheBytes = &b.Cache.Bytes
		if a.Cache != nil && b.Cache.Hits >= a.Cache.Hits && b.Cache.Misses >= a.Cache.Misses {
			// In floating point: the sum of two untrusted counts may wrap.
			hits, misses := float64(b.Cache.Hits-a.Cache.Hits), float64(b.Cache.Misses-a.Cache.Misses)
			if hits+misses > 0 {
				rate := hits / (hits + misses)
				s.CacheHitRate = &rate
			}
		}
	}
	return s
}

// plainName reports whether a stage name is 1..32 of [A-Za-z0-9_.-]: it
// is printed on an operator's terminal, so no control characters or
// escape sequences get through (review 35, A2).
func plainName(k string) bool {
	if len(k) == 0 || len(k) > 32 {
		return false
	}
	for _, c := range []byte(k) {
		ok := c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '_' || c == '.' || c == '-'
		if !ok {
			return false
		}
	}
	return true
}

// stageNames is the stages of m in a Pipeline's order, then the rest sorted.
func stageNames(m map[string]float64) []string {
	var out, rest []string
	for _, k := range stageOrder {
		if _, ok := m[k]; ok {
			out = append(out, k)
		}
	}
	for k := range m {
		if !contains(stageOrder, k) {
			rest = append(rest, k)
		}
	}
	sort.Strings(rest)
	return append(out, rest...)
}

func contains(list []string, s string) bool {
	for _, x := range list {
		if x == s {
			return true
		}
	}
	return false
}

// printPipeline is stat's line on the producer's pipeline.
func printPipeline(w io.Writer, p *pipelineSample) {
	if p == nil {
		return
	}
	var b strings.Builder
	fmt.Fprintf(&b, "  pipeline: %d workers", p.Workers)
	if p.IOThreads > 0 {
		fmt.Fprintf(&b, " x %d read threads", p.IOThreads)
	}
	b.WriteString("; busy (s/s):")
	for _, k := range stageNames(p.StageBusy) {
		fmt.Fprintf(&b, " %s %.2f", k, p.StageBusy[k])
	}
	if p.CacheBytes != nil {
		b.WriteString("; cache ")
		if p.CacheHitRate != nil {
			fmt.Fprintf(&b, "%.1f%% hits, ", 100**p.CacheHitRate)
		}
		b.WriteString(humanBytes(*p.CacheBytes))
	}
	fmt.Fprintln(w, b.String())
}

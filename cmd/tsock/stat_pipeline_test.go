package main

import (
	"encoding/json"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
)

// TestPipelineNote: the figures a producer's Pipeline writes are read only
// when they are the producer's (pid), a regular file, small and sane.
func TestPipelineNote(t *testing.T) {
	name := chanName(t, "note")
	path := filepath.Join(shmDir, statsNotePrefix+name)
	t.Cleanup(func() { _ = os.Remove(path) })
	write := func(text string) {
		require.NoError(t, os.WriteFile(path, []byte(text), 0o644))
	}
	uid := uint32(os.Geteuid())
	good := `{"pid":4242,"workers":3,"io_threads":8,"stage_s":{"decode":10.5,"read":1,"augment":0.5},` +
		`"cache":{"hits":10,"misses":30,"bytes":4096}}`
	write(good)
	n := readPipelineNote(name, uid, 4242)
	require.NotNil(t, n)
	assert.Equal(t, 3, n.Workers)
	assert.Equal(t, 10.5, n.StageS["decode"])
	assert.Nil(t, readPipelineNote(name, uid, 4243), "another producer's figures")
	assert.Nil(t, readPipelineNote(name, uid+1, 4242), "a file of another user than the segment's")
	for _, bad := range []string{
		`{"pid":4242,"workers":-1}`,
		`{"pid":4242,"stage_s":{"decode":-1}}`,
		`{"pid":4242,"stage_s":{"":1}}`,
		`{"pid":4242,"stage_s":{"de\u001b]0;owned\u0007code":1}}`,
		`{"pid":4242,"workers":3`,
		fmt.Sprintf(`{"pid":4242,"pad":"%0*d"}`, statsNoteMax, 0),
	} {
		write(bad)
		assert.Nil(t, readPipelineNote(name, uid, 4242), bad)
	}
	require.NoError(t, os.Remove(path))
	require.NoError(t, os.Symlink("/etc/passwd", path))
	assert.Nil(t, readPipelineNote(name, uid, 4242), "a symbolic link is not followed")
}

// TestPipelineBetween: stage seconds per second and the cache's hit rate
// over an interval, from two notes of one producer.
func TestPipelineBetween(t *testing.T) {
	a := &pipelineNote{Pid: 7, Workers: 2, StageS: map[string]float64{"decode": 10, "read": 1, "zz": 0}}
	b := &pipelineNote{Pid: 7, Workers: 3, IOThreads: 4, StageS: map[string]float64{"decode": 14, "read": 1.5, "zz": 1}}
	a.Cache = &struct {
		Hits   uint64 `json:"hits"`
		Misses uint64 `json:"misses"`
		Bytes  uint64 `json:"bytes"`
	}{Hits: 10, Misses: 10, Bytes: 100}
	b.Cache = &struct {
		Hits   uint64 `json:"hits"`
		Misses uint64 `json:"misses"`
		Bytes  uint64 `json:"bytes"`
	}{Hits: 40, Misses: 20, Bytes: 200}
	s := pipelineBetween(a, b, 2)
	require.NotNil(t, s)
	huge := *b
	huge.Cache = &struct {
		Hits   uint64 `json:"hits"`
		Misses uint64 `json:"misses"`
		Bytes  uint64 `json:"bytes"`
	}{Hits: 1 << 63, Misses: 1 << 63, Bytes: 1}
	hs := pipelineBetween(a, &huge, 2)
	require.NotNil(t, hs.CacheHitRate)
	assert.InDelta(t, 0.5, *hs.CacheHitRate, 1e-6, "counts whose sum wraps")
	inf := pipelineBetween(a, &pipelineNote{Pid: 7, StageS: map[string]float64{"decode": math.MaxFloat64}}, 1e-300)
	require.NotNil(t, inf)
	_, err := json.Marshal(inf)
	require.NoError(t, err, "an interval's figures always encode")
	assert.Equal(t, 3, s.Workers)
	assert.InDelta(t, 2.0, s.StageBusy["decode"], 1e-9)
	assert.InDelta(t, 0.25, s.StageBusy["read"], 1e-9)
	require.NotNil(t, s.CacheHitRate)
	assert.InDelta(t, 0.75, *s.CacheHitRate, 1e-9)
	assert.Equal(t, uint64(200), *s.CacheBytes)
	assert.Equal(t, []string{"read", "decode", "zz"}, stageNames(s.StageBusy))
	assert.Nil(t, pipelineBetween(a, &pipelineNote{Pid: 8}, 2), "another producer")
	assert.Nil(t, pipelineBetween(nil, b, 2))
	var out strings.Builder
	printPipeline(&out, s)
	assert.Contains(t, out.String(), "pipeline: 3 workers x 4 read threads; busy (s/s): read 0.25 decode 2.00 zz 0.50; cache 75.0% hits")
}

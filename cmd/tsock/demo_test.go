package main

import (
	"bytes"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/tsock/tsock/ring"
)

// asMainEnv makes the test binary behave as tsock itself. The demo starts
// its readers by re-executing os.Executable(), which under `go test` is the
// test binary; with this variable set (and inherited by the children),
// TestMain hands the arguments to run instead of the test framework.
const asMainEnv = "TSOCK_TEST_AS_MAIN"

func TestMain(m *testing.M) {
	if os.Getenv(asMainEnv) == "1" {
		os.Exit(run(os.Args[1:], &env{stdout: os.Stdout, stderr: os.Stderr}))
	}
	os.Exit(m.Run())
}

// runInProcess runs tsock with args in this process and returns the exit
// status and output.
func runInProcess(t *testing.T, args ...string) (int, string, string) {
	t.Helper()
	t.Setenv(asMainEnv, "1")
	var out, errb bytes.Buffer
	rc := run(args, &env{stdout: &out, stderr: &errb})
	return rc, out.String(), errb.String()
}

func demoName(t *testing.T) string {
	return fmt.Sprintf("tsock-demotest-%d-%s", os.Getpid(), strings.ReplaceAll(t.Name(), "/", "_"))
}

func TestDemoJSON(t *testing.T) {
	rc, out, errs := runInProcess(t, "demo", "--readers", "2", "--batches", "500", "--epochs", "2",
		"--batch-bytes", "16384", "--slots", "8", "--name", demoName(t), "--json")
	if rc != exitOK {
		t.Fatalf("demo exited %d\nstdout:\n%s\nstderr:\n%s", rc, out, errs)
	}
	var res demoResult
	if err := json.Unmarshal([]byte(out), &res); err != nil {
		t.Fatalf("demo output is not JSON: %v\n%s", err, out)
	}
	if !res.OK || res.Error != "" {
		t.Fatalf("demo not OK: %+v", res)
	}
	if res.Producer.Batches != 1000 || res.Producer.Epochs != 2 {
		t.Errorf("producer published %d batches in %d epochs, want 1000 in 2", res.Producer.Batches, res.Producer.Epochs)
	}
	if len(res.Readers) != 2 {
		t.Fatalf("%d reader results, want 2", len(res.Readers))
	}
	pids := map[int]bool{}
	for i, r := range res.Readers {
		if !r.OK || r.ChecksumOK != 1000 || r.ChecksumBad != 0 || r.OrderErrors != 0 ||
			r.Batches != 1000 || r.Epochs != 2 || r.End != "closed" {
			t.Errorf("reader %d: %+v", i, r)
		}
		if r.Pid == os.Getpid() || pids[r.Pid] {
			t.Errorf("reader %d ran in pid %d: not a separate process", i, r.Pid)
		}
		pids[r.Pid] = true
		if want := 1000 * res.BatchBytes; r.Bytes != want {
			t.Errorf("reader %d verified %d bytes, want %d", i, r.Bytes, want)
		}
	}
	if _, err := os.Stat(ring.ChannelPath(res.Channel)); !os.IsNotExist(err) {
		t.Errorf("channel segment left behind (stat: %v)", err)
	}
}

// TestDemoDetectsBadChecksum makes the producer lie about one checksum and
// expects every reader, and the demo, to fail.
func TestDemoDetectsBadChecksum(t *testing.T) {
	rc, out, errs := runInProcess(t, "demo", "--readers", "2", "--batches", "50", "--epochs", "1",
		"--batch-bytes", "4096", "--name", demoName(t), "--corrupt-batch", "7")
	if rc != exitFail {
		t.Fatalf("demo exited %d, want %d\nstdout:\n%s\nstderr:\n%s", rc, exitFail, out, errs)
	}
	if got := strings.Count(out, "1 BAD"); got != 2 {
		t.Errorf("%d readers report 1 bad batch, want 2:\n%s", got, out)
	}
	if !strings.Contains(out, "batch 6 of epoch 0") || !strings.Contains(out, "FAILED: 2 of 2 readers failed") {
		t.Errorf("table does not name the bad batch or the failure:\n%s", out)
	}
}

// TestDemoBinary builds the real executable and runs the demo through it,
// with the table output.
func TestDemoBinary(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Skip("go tool not found")
	}
	bin := filepath.Join(t.TempDir(), "tsock")
	build := exec.Command(gobin, "build", "-o", bin, ".")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	cmd := exec.Command(bin, "demo", "--readers", "2", "--batches", "500", "--name", demoName(t))
	var stderr bytes.Buffer
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("tsock demo: %v\nstdout:\n%s\nstderr:\n%s", err, out, stderr.String())
	}
	s := string(out)
	for _, want := range []string{"ROLE", "reader 0", "reader 1", "producer", "OK: 2 readers each verified 1000 batches;"} {
		if !strings.Contains(s, want) {
			t.Errorf("output lacks %q:\n%s", want, s)
		}
	}
	if n := strings.Count(s, "  OK  "); n != 2 {
		t.Errorf("%d readers with checksums OK, want 2:\n%s", n, s)
	}
	if v, err := exec.Command(bin, "version").Output(); err != nil || !strings.HasPrefix(string(v), "tsock ") {
		t.Errorf("tsock version: %q, %v", v, err)
	}
}

func TestHelpAndUsage(t *testing.T) {
	rc, out, _ := runInProcess(t, "help")
	if rc != exitOK || !strings.Contains(out, "demo") || !strings.Contains(out, "version") {
		t.Errorf("help: rc %d\n%s", rc, out)
	}
	if strings.Contains(out, "demo-reader") {
		t.Errorf("help lists the hidden demo-reader:\n%s", out)
	}
	rc, out, _ = runInProcess(t, "help", "demo")
	if rc != exitOK || !strings.Contains(out, "-readers") || strings.Contains(out, "corrupt-batch") {
		t.Errorf("help demo: rc %d\n%s", rc, out)
	}
	if rc, _, _ = runInProcess(t, "no-such-command"); rc != exitUsage {
		t.Errorf("unknown command: rc %d, want %d", rc, exitUsage)
	}
	if rc, _, _ = runInProcess(t, "demo", "--readers", "0"); rc != exitUsage {
		t.Errorf("demo --readers 0: rc %d, want %d", rc, exitUsage)
	}
	if rc, _, _ = runInProcess(t); rc != exitUsage {
		t.Errorf("no arguments: rc %d, want %d", rc, exitUsage)
	}
}

func TestDemoLayout(t *testing.T) {
	for _, n := range []uint64{16, 17, 23, 100, 264, 4096, 65536, 1 << 20} {
		l, err := newDemoLayout(n)
		if err != nil {
			t.Fatalf("%d: %v", n, err)
		}
		if l.total > n || l.labelOff%8 != 0 || l.labelOff < l.featBytes || l.rows < 1 {
			t.Errorf("%d: bad layout %+v", n, l)
		}
		buf := make([]byte, l.total)
		m, err := parseDemoMeta(l.fill(buf, 3, 9))
		if err != nil || m.epoch != 3 || m.index != 9 {
			t.Errorf("%d: meta %+v, %v", n, m, err)
		}
	}
	if _, err := newDemoLayout(15); err == nil {
		t.Errorf("15 bytes accepted")
	}
}

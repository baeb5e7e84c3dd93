package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"testing"
)

// The soak starts its Go readers and its producer by re-executing
// os.Executable(), the test binary under `go test`: with asMainEnv set
// (the soak sets it for its children), TestMain runs the command instead
// of the tests.
func TestMain(m *testing.M) {
	if os.Getenv(asMainEnv) == "1" {
		os.Exit(realMain(os.Args[1:], os.Stdout, os.Stderr))
	}
	os.Exit(m.Run())
}

// TestSoakShort runs the chaos soak for 12 seconds: 8 readers (3 C, 2 Python,
// 3 Go; C and Go only when there is no .venv/bin/python or reader library)
// killed, stopped and restarted every ~100 ms, the producer (C on
// libtsock.so and Go in turn) killed and restarted every ~3 s; the C
// producer and the C and Python readers fork children without exec that
// outlive them (issue 17). The long run is `go run ./tests/soak` (10
// minutes).
func TestSoakShort(t *testing.T) {
	if testing.Short() {
		t.Skip("12 s soak")
	}
	if _, err := exec.LookPath("cc"); err != nil && os.Getenv("CC") == "" {
		t.Skip("no C compiler for the C readers")
	}
	var out, log bytes.Buffer
	rc := realMain([]string{"--duration", "12s", "--producer-every", "3s", "--rate", "400", "--status-every", "1h",
		"--json"}, &out, &log)
	var res Result
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatalf("soak output is not JSON: %v\n%s\nlog:\n%s", err, out.String(), log.String())
	}
	t.Logf("soak: %+v", res)
	if res.PyFallback != "" {
		t.Logf("no Python readers: %s", res.PyFallback)
	}
	for kind, k := range res.Kinds {
		t.Logf("%s readers %d: %+v", kind, k.Slots, *k)
	}
	if rc != 0 || !res.OK {
		t.Fatalf("soak failed (exit %d): %v\nlog:\n%s", rc, res.Failures, log.String())
	}
	switch {
	case res.Kills == 0 || res.Restarts != res.Kills:
		t.Errorf("%d reader kills, %d restarts", res.Kills, res.Restarts)
	case res.Stops == 0:
		t.Errorf("no reader was stopped")
	case res.ProducerRestarts < 2:
		t.Errorf("%d producer restarts, want at least 2", res.ProducerRestarts)
	case res.GoneChecks == 0:
		t.Errorf("no reader reported a producer gone after reading everything")
	case res.GatingKills == 0:
		t.Errorf("no kill of the reader the producer waited for was measured")
	case res.Verified == 0 || res.Published == 0:
		t.Errorf("published %d, verified %d", res.Published, res.Verified)
	case res.RecordsChecked == 0:
		t.Errorf("reader records were not checked at the end")
	case res.CProducers == 0 || res.GoProducers == 0:
		t.Errorf("%d C and %d Go producer incarnations, want both", res.CProducers, res.GoProducers)
	case res.GoneTimed == 0:
		t.Errorf("no reader's \"producer gone\" was timed after a producer kill")
	case !res.Forking || res.ReaderForks == 0 || res.ProducerForks == 0:
		t.Errorf("forking %v: %d children forked by readers, %d by producers", res.Forking, res.ReaderForks,
			res.ProducerForks)
	case res.PyReaders > 0 && (res.Kinds["python"] == nil || res.Kinds["python"].Forks == 0):
		t.Errorf("the Python readers forked no child")
	case res.GatingKillsChild == 0:
		t.Errorf("no measured kill of a gating reader whose forked child lived on")
	case res.ProducerKillsChild == 0:
		t.Errorf("no producer kill whose forked child lived until the next producer took the name")
	}
}

// TestSoakShortDevice runs the soak for 8 seconds on the device path, with
// the fake CUDA driver (built from tests/c/fake_cuda.c): a producer with a
// device pool, killed every ~3 s; C readers that check every device copy
// against the host copy and a GPU read queued before each release.
func TestSoakShortDevice(t *testing.T) {
	if testing.Short() {
		t.Skip("8 s soak")
	}
	if _, err := exec.LookPath("cc"); err != nil && os.Getenv("CC") == "" {
		t.Skip("no C compiler for the C readers and the fake driver")
	}
	var out, log bytes.Buffer
	rc := realMain([]string{"--duration", "8s", "--device", "--readers", "5", "--c-readers", "3", "--py-readers", "0",
		"--producer-every", "3s", "--rate", "400", "--status-every", "1h", "--json"}, &out, &log)
	var res Result
	if err := json.Unmarshal(out.Bytes(), &res); err != nil {
		t.Fatalf("soak output is not JSON: %v\n%s\nlog:\n%s", err, out.String(), log.String())
	}
	t.Logf("soak: %+v", res)
	if rc != 0 || !res.OK {
		t.Fatalf("soak failed (exit %d): %v\nlog:\n%s", rc, res.Failures, log.String())
	}
	if res.DeviceVerified == 0 || res.DeviceReads == 0 || res.Kills == 0 {
		t.Errorf("device copies %d, GPU reads %d, kills %d", res.DeviceVerified, res.DeviceReads, res.Kills)
	}
}

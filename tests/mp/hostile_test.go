package mp

// Hostile readers (issue 10 section 3, issue 17's threat model): a process
// that may read a channel, of the channel's user or of another one in its
// group, joins it with the protocol spoken by hand (testkit.Rogue) and
// does everything it can with what it gets: garbage in its own record,
// its cursor far ahead and far behind, its sleeping flag set for ever,
// floods of bytes on its connection, attempts to resize its record's
// file; and, on the join socket, connections that say nothing, garbage,
// a descriptor that proves nothing. Honest readers read every batch
// throughout, and the producer goes on (the reader whose cursor stays
// behind is evicted, as any stuck reader is under the eviction policy).

import (
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// TestHelperHostile is a child process: ROLE NAME SECONDS.
//
//	rogue  joins, abuses its own record and connection for SECONDS, then
//	       leaves its cursor far behind until it is evicted (30 s at most)
//	knock  abuses the join socket: silent connections, malformed requests,
//	       descriptors that prove nothing; one line per case
//	linger ADDR NAME MEMBER [HEAVY LIGHT]: sends descriptors whose close
//	       blocks, then floods the join socket with others
//	       (linger_test.go)
//
// Both print "DONE <what>" for anything that should have been refused and
// was not, and "attacker finished" at the end.
func TestHelperHostile(t *testing.T) {
	if os.Getenv(envRole) != "hostile" {
		t.Skip("helper process")
	}
	args := strings.Fields(os.Getenv(envArgs))
	if args[0] == "linger" {
		heavy, light := 0, 0
		if len(args) > 5 {
			heavy, _ = strconv.Atoi(args[4])
			light, _ = strconv.Atoi(args[5])
		}
		lingerAttack(args[1], args[2], args[3] == "1", heavy, light)
		os.Exit(0)
	}
	secs, _ := strconv.Atoi(args[2])
	d := time.Duration(secs) * time.Second
	switch args[0] {
	case "rogue":
		rogue(args[1], d)
	case "knock":
		knock(args[1], d)
	}
	fmt.Println("attacker finished")
	os.Exit(0)
}

func rogue(name string, d time.Duration) {
	r, err := testkit.JoinRogue(name, uint32(reader.StartNow))
	if err != nil {
		fmt.Println("rogue cannot join:", err)
		return
	}
	defer r.Close()
	fmt.Printf("rogue joined entry %d\n", r.Reply.Index)
	seg, err := ring.OpenSegment(name)
	if err != nil {
		fmt.Println("rogue cannot read the channel:", err)
		return
	}
	defer seg.Close()
	words := []uintptr{ring.RecordOffCursor, ring.RecordOffAcquired, ring.RecordOffHeartbeatNs,
		ring.RecordOffWaitNs, ring.RecordOffBatches, ring.RecordOffPlacement, ring.RecordOffGPUUUID}
	spam := make([]byte, 64)
	end := time.Now().Add(d)
	for k := 0; time.Now().Before(end); k++ {
		for _, off := range words {
			r.Set(off, rand.Uint64())
		}
		switch k % 3 {
		case 0:
			r.Set(ring.RecordOffCursor, ^uint64(0)) // far ahead
		case 1:
			r.Set(ring.RecordOffCursor, seg.Published()+1000)
		}
		r.SetSleeping(true) // and never asleep
		for i := 0; i < 64; i++ {
			for j := range spam {
				if spam[j] = byte(rand.Uint32()); spam[j] == ring.MsgLeave {
					spam[j]++ // a leave would end its stay: it wants to stay
				}
			}
			_ = r.Send(spam[:1+rand.IntN(len(spam))])
		}
		for _, size := range []int64{0, 100, 1 << 20} {
			if r.Truncate(size) == nil {
				fmt.Printf("DONE resize the record's file to %d bytes\n", size)
			}
		}
		if _, err := unix.FcntlInt(uintptr(r.RecFd), unix.F_ADD_SEALS, unix.F_SEAL_WRITE); err == nil {
			fmt.Println("DONE seal the record against the producer")
		}
		if _, err := unix.Pwrite(r.RecFd, []byte{1}, ring.RecordFileBytes); err == nil {
			fmt.Println("DONE grow the record by writing past its end")
		}
		// Allowed, and harmless: the pages read back as zeros.
		_ = unix.Fallocate(r.RecFd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 0, ring.RecordFileBytes)
		time.Sleep(time.Millisecond)
	}
	// Stuck far behind: the eviction policy must take it off the gate.
	r.Set(ring.RecordOffCursor, 0)
	for end := time.Now().Add(30 * time.Second); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if ring.ClaimState(seg.Claim(r.Reply.Index)) == ring.ReaderEvicted {
			fmt.Println("rogue evicted")
			return
		}
		r.Set(ring.RecordOffCursor, 0)
	}
	fmt.Println("rogue not evicted")
}

// knock abuses the join socket; each case prints "knock CASE: OUTCOME",
// OUTCOME the status of the producer's refusal or "closed".
func knock(name string, d time.Duration) {
	path := ring.ChannelPath(name)
	seg, err := os.Open(path)
	if err != nil {
		fmt.Println("knock cannot read the channel:", err)
		return
	}
	defer seg.Close()
	opath, err := unix.Open(path, unix.O_PATH|unix.O_CLOEXEC, 0)
	if err != nil {
		fmt.Println("knock: O_PATH:", err)
		return
	}
	defer unix.Close(opath)
	other, _ := os.Open("/proc/self/status")
	defer other.Close()
	segFd := int(seg.Fd())
	bad := ring.NewJoinRequest(0)
	bad.Magic ^= 1
	version := ring.NewJoinRequest(0)
	version.LayoutVersion++
	reserved := ring.NewJoinRequest(0)
	reserved.Reserved = 1
	mode := ring.NewJoinRequest(7)
	good := ring.NewJoinRequest(0).Bytes()
	for _, c := range []struct {
		what string
		req  []byte
		fds  []int
	}{
		{"bad magic", bad.Bytes(), []int{segFd}},
		{"short", good[:8], []int{segFd}},
		{"long", append(append([]byte{}, good...), 1, 2, 3), []int{segFd}},
		{"other version", version.Bytes(), []int{segFd}},
		{"reserved set", reserved.Bytes(), []int{segFd}},
		{"unknown start mode", mode.Bytes(), []int{segFd}},
		{"no descriptor", good, nil},
		{"three descriptors", good, []int{segFd, segFd, segFd}},
		{"O_PATH descriptor", good, []int{opath}},
		{"another file", good, []int{int(other.Fd())}},
	} {
		fmt.Printf("knock %s: %s\n", c.what, tryJoin(name, c.req, c.fds))
	}
	// Silent connections, more than one user's share of pending joins.
	var silent []int
	for i := 0; i < 40; i++ {
		if c, err := testkit.Dial(name); err == nil {
			silent = append(silent, c)
		}
	}
	fmt.Printf("knock silent: %d connected\n", len(silent))
	// The silent ones are dropped after the producer's handshake timeout.
	start := time.Now()
	dropped := 0
	for _, c := range silent {
		var b [64]byte
		tv := unix.NsecToTimeval(int64(d))
		_ = unix.SetsockoptTimeval(c, unix.SOL_SOCKET, unix.SO_RCVTIMEO, &tv)
		if n, _ := unix.Read(c, b[:]); n <= 0 {
			dropped++
		}
		unix.Close(c)
	}
	fmt.Printf("knock silent: %d dropped within %.1f s\n", dropped, time.Since(start).Seconds())
}

// tryJoin sends one request and says how the producer answered.
func tryJoin(name string, req []byte, fds []int) string {
	c, err := testkit.Dial(name)
	if err != nil {
		return "dial: " + err.Error()
	}
	defer unix.Close(c)
	if err := testkit.SendRequest(c, req, fds...); err != nil {
		return "send: " + err.Error()
	}
	rep, fd, err := testkit.ReadReply(c)
	if fd >= 0 {
		unix.Close(fd)
		return "DONE joined"
	}
	if err != nil {
		return "closed"
	}
	return "status " + strconv.Itoa(int(rep.Status))
}

// TestRogueReaderHarmsNobody: a rogue of the channel's user, and one of
// another user in the channel's group, do their worst while two honest
// readers (C and Go) read every batch and the producer publishes.
func TestRogueReaderHarmsNobody(t *testing.T) {
	testkit.NeedRoot(t)
	exe := testkit.ExecutableForOthers(t)
	for _, c := range []struct {
		label string
		uid   int // -1: the channel's user
	}{{"same uid", -1}, {"other uid", testkit.Nobody}} {
		t.Run(c.label, func(t *testing.T) { rogueCase(t, exe, c.uid) })
	}
}

func rogueCase(t *testing.T, exe string, uid int) {
	const n = 600
	name := channel(t)
	// Generous: an honest reader descheduled on a loaded machine must not
	// stay at the minimum that long.
	const evictAfter = 3 * time.Second
	p := create(t, name, producer.Options{Slots: 4, SlotBytes: batchgen.MaxPayload, Mode: 0o660, Gid: sharedGid,
		EvictAfter: evictAfter})
	cr := startReader(t, name, readerSpec{lang: "c", expected: n, start: "now"}, "honest c reader")
	gr := startReader(t, name, readerSpec{lang: "go", expected: n, start: "now"}, "honest go reader")
	require.NoError(t, p.WaitReaders(2, 30*time.Second))

	attr := func() *syscall.SysProcAttr {
		if uid < 0 {
			return &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
		}
		return testkit.AsUser(uint32(uid), uint32(uid), sharedGid)
	}
	env := func(args ...string) []string {
		return []string{envRole + "=hostile", envArgs + "=" + strings.Join(args, " ")}
	}
	rg := startAttr(t, "rogue", env("rogue", name, "1"), attr(), exe, "-test.run=^TestHelperHostile$")
	rg.waitLine(t, "rogue joined", 30*time.Second)
	kn := startAttr(t, "knock", env("knock", name, "10"), attr(), exe, "-test.run=^TestHelperHostile$")
	kn.waitLine(t, "knock silent:", 30*time.Second)

	if uid >= 0 {
		// Another user's flood of silent connections does not keep the
		// channel's user out.
		start := time.Now()
		r, err := reader.Attach(name, reader.Options{Start: reader.StartNow, AttachTimeout: 10 * time.Second})
		require.NoError(t, err)
		took := time.Since(start)
		require.NoError(t, r.Detach())
		assert.Less(t, took, 5*time.Second, "attach while another user floods the join socket")
	}

	// Paced so that the rogue's stuck phase comes while the honest readers
	// read; and on past n (to readers gone) until the rogue is done.
	var slowest time.Duration
	rogueDone := func() bool { return strings.Contains(rg.Output(), "evicted\n") }
	deadline := time.Now().Add(60 * time.Second)
	for i := uint64(0); (i < n || !rogueDone()) && time.Now().Before(deadline); i++ {
		start := time.Now()
		_, err := publish(p, i, 30*time.Second)
		require.NoError(t, err, "publish %d", i)
		slowest = max(slowest, time.Since(start))
		time.Sleep(5 * time.Millisecond)
	}
	for _, h := range []*proc{cr, gr} {
		require.Equal(t, 0, h.wait(t, 60*time.Second), "%s: %s", h.label, h.Output())
		assert.Equal(t, uint64(n), h.result(t).Batches, "%s read every batch, intact", h.label)
	}
	rg.waitLine(t, "attacker finished", 60*time.Second)
	kn.waitLine(t, "attacker finished", 60*time.Second)
	for _, a := range []*proc{rg, kn} {
		assert.NotContains(t, a.Output(), "DONE", "%s did what it should not", a.label)
		assert.NotContains(t, a.Output(), "cannot", "%s is a reader of the channel", a.label)
	}
	assert.Contains(t, rg.Output(), "rogue evicted", "stuck far behind, it is taken off the gate")
	assert.GreaterOrEqual(t, p.Stats().ReadersEvicted, uint64(1))
	// The slowest publish waited for the eviction (EvictAfter), not much more.
	assert.Less(t, slowest, 5*evictAfter)
	t.Logf("slowest publish %v", slowest)

	out := kn.Output()
	for what, want := range map[string]int{"bad magic": ring.StatusInval, "short": ring.StatusInval,
		"long": ring.StatusInval, "other version": ring.StatusVersion, "reserved set": ring.StatusInval,
		"unknown start mode": ring.StatusInval, "no descriptor": ring.StatusInval,
		"O_PATH descriptor": ring.StatusPerm, "another file": ring.StatusPerm} {
		assert.Contains(t, out, fmt.Sprintf("knock %s: status %d\n", what, want), "the producer refuses %s", what)
	}
	// A request with more than one descriptor is never received (its
	// descriptors stay in the connection, released by a discard worker):
	// the refusal races the connection's reset, so either may arrive.
	assert.Regexp(t, fmt.Sprintf("knock three descriptors: (status %d|closed)\n", ring.StatusInval), out)
	assert.Contains(t, out, "knock silent: 40 connected")
	assert.Contains(t, out, "knock silent: 40 dropped")
}

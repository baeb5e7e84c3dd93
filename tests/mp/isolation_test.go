package mp

// Who can harm whom (issue 10, section 3): a reader of another uid on a
// group-shared channel can read it, and nothing more. It cannot open the
// segment for writing, map it writable, truncate it (the producer used to
// die of SIGBUS), nor reach another reader's record (it used to rewrite
// other readers' cursors, and the producer overwrote batches they held).
// The producer and the attackers are child processes, so that a producer
// killed by an attack shows as such.

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/ring"
)

// TestHelperIsolation is a child process: ROLE ARGS...
//
//	producer NAME N SLOTS  a group-shared producer (mode 0660, group sharedGid):
//	                       publishes N test batches once a reader is attached,
//	                       waits until they are read, "producer published N"
//	vandal NAME SECONDS    tries, for that long, to change the segment: open it
//	                       for writing, map it writable, truncate it; whatever
//	                       works, it uses (garbage over slots, payload and the
//	                       reader area; truncation)
//	reach NAME SECONDS PID...  tries to reach other processes' records: the
//	                       segment's reader area, and every descriptor and the
//	                       memory of each PID through /proc
//
// Attackers print "DONE <what>" for each attack that worked, "refused
// <what>: <error>" for each that did not, then "attacker finished".
func TestHelperIsolation(t *testing.T) {
	if os.Getenv(envRole) != "isolation" {
		t.Skip("helper process")
	}
	args := strings.Fields(os.Getenv(envArgs))
	switch args[0] {
	case "producer":
		n, _ := strconv.ParseUint(args[2], 10, 64)
		slots, _ := strconv.ParseUint(args[3], 10, 32)
		os.Exit(isolationProducer(args[1], n, uint32(slots)))
	case "vandal":
		secs, _ := strconv.Atoi(args[2])
		vandal(args[1], time.Duration(secs)*time.Second)
	case "reach":
		secs, _ := strconv.Atoi(args[2])
		reach(args[1], time.Duration(secs)*time.Second, args[3:])
	}
	fmt.Println("attacker finished")
	os.Exit(0)
}

func isolationProducer(name string, n uint64, slots uint32) int {
	p, err := producer.Create(name, producer.Options{Slots: slots, SlotBytes: batchgen.MaxPayload,
		Mode: 0o660, Gid: sharedGid})
	if err != nil {
		fmt.Println("producer error:", err)
		return 1
	}
	fmt.Println("producer created")
	if err := p.WaitReaders(1, 30*time.Second); err != nil {
		fmt.Println("producer error:", err)
		return 1
	}
	for i := uint64(0); i < n; i++ {
		if _, err := publish(p, i, 30*time.Second); err != nil {
			fmt.Println("producer error:", err)
			return 1
		}
		time.Sleep(2 * time.Millisecond) // the attackers get their chances
	}
	if err := waitDrained(p, 30*time.Second); err != nil {
		fmt.Println("producer error:", err)
		return 1
	}
	fmt.Printf("producer published %d\n", n)
	p.Close()
	return 0
}

// reported holds the attacks already reported: each is printed once.
var reported = map[string]bool{}

func attack(what string, err error) bool {
	if !reported[what] {
		reported[what] = true
		if err != nil {
			fmt.Printf("refused %s: %v\n", what, err)
		} else {
			fmt.Printf("DONE %s\n", what)
		}
	}
	return err == nil
}

// vandal tries every way a process that may read a file has to change it.
func vandal(name string, d time.Duration) {
	path := ring.ChannelPath(name)
	end := time.Now().Add(d)
	readable := false
	for time.Now().Before(end) {
		try := attack
		if f, err := os.OpenFile(path, os.O_RDWR, 0); try("open read-write", err) {
			scribble(f)
			try("truncate", f.Truncate(4096))
			f.Close()
		}
		if f, err := os.OpenFile(path, os.O_WRONLY, 0); try("open write-only", err) {
			f.Close()
		}
		f, err := os.Open(path) // allowed: it may read the channel
		if err != nil {
			if !readable {
				fmt.Printf("cannot read the channel: %v\n", err)
			}
			return // or it was closed meanwhile
		}
		readable = true
		fd := int(f.Fd())
		if m, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED); try("map writable", err) {
			m[ring.HeaderOffPublished] ^= 0xff
			unix.Munmap(m)
		}
		if m, err := unix.Mmap(fd, 0, 4096, unix.PROT_READ, unix.MAP_SHARED); err == nil {
			try("make a read-only mapping writable", unix.Mprotect(m, unix.PROT_READ|unix.PROT_WRITE))
			unix.Munmap(m)
		}
		try("truncate through a read-only descriptor", unix.Ftruncate(fd, 4096))
		try("punch a hole through a read-only descriptor",
			unix.Fallocate(fd, unix.FALLOC_FL_PUNCH_HOLE|unix.FALLOC_FL_KEEP_SIZE, 4096, 1<<20))
		try("change the mode", f.Chmod(0o666))
		f.Close()
		time.Sleep(10 * time.Millisecond)
	}
}

// scribble writes garbage over everything after the header of a segment
// open for writing: reader area, slots, payload.
func scribble(f *os.File) {
	st, err := f.Stat()
	if err != nil {
		return
	}
	junk := make([]byte, 64<<10)
	for i := range junk {
		junk[i] = byte(i*7 + 3)
	}
	for off := int64(4096); off < st.Size(); off += int64(len(junk)) {
		f.WriteAt(junk, off)
	}
}

// reach tries to write other readers' records: through the segment (where
// they lived up to layout 3), and through /proc: every descriptor of each
// process (a record's memfd is one of the producer's), and its memory.
func reach(name string, d time.Duration, pids []string) {
	path := ring.ChannelPath(name)
	seg, err := ring.OpenSegment(name) // allowed: it may read the channel
	if err != nil {
		fmt.Printf("cannot read the channel: %v\n", err)
		return
	}
	areaEnd := int64(seg.Geometry.SlotsOffset)
	seg.Close()
	end := time.Now().Add(d)
	ff := make([]byte, areaEnd-4096)
	for i := range ff {
		ff[i] = 0xff // every cursor far ahead, every claim garbage
	}
	for time.Now().Before(end) {
		try := attack
		if f, err := os.OpenFile(path, os.O_RDWR, 0); try("open the segment read-write", err) {
			_, err := f.WriteAt(ff, 4096)
			try("overwrite the reader area", err)
			f.Close()
		}
		if f, err := os.Open(path); err == nil {
			_, err := unix.Mmap(int(f.Fd()), 0, int(areaEnd), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
			try("map the reader area writable", err)
			f.Close()
		}
		for _, pid := range pids {
			ents, err := os.ReadDir("/proc/" + pid + "/fd")
			try("list the descriptors of pid "+pid, err)
			for _, e := range ents {
				p := filepath.Join("/proc", pid, "fd", e.Name())
				if f, err := os.OpenFile(p, os.O_RDWR, 0); try("open "+p+" read-write", err) {
					f.Close()
				}
			}
			if f, err := os.OpenFile("/proc/"+pid+"/mem", os.O_RDWR, 0); try("open the memory of pid "+pid, err) {
				f.Close()
			}
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// startIsolation starts TestHelperIsolation as uid, in the channel's
// group, or with uid < 0 as this process's user.
func startIsolation(t *testing.T, exe string, uid int, label string, args ...string) *proc {
	t.Helper()
	env := []string{envRole + "=isolation", envArgs + "=" + strings.Join(args, " ")}
	attr := &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	if uid >= 0 {
		attr = testkit.AsUser(uint32(uid), uint32(uid), sharedGid)
	}
	return startAttr(t, label, env, attr, exe, "-test.run=^TestHelperIsolation$")
}

// attackerResult waits for an attacker and returns what worked; it fails
// the test if the attacker could not even read the channel, or tried
// fewer than min attacks (a vacuous attacker proves nothing).
func attackerResult(t *testing.T, a *proc, min int) []string {
	t.Helper()
	a.waitLine(t, "attacker finished", 60*time.Second)
	var done []string
	tried := 0
	for _, l := range strings.Split(a.Output(), "\n") {
		if strings.HasPrefix(l, "DONE ") {
			done = append(done, l)
		}
		if strings.HasPrefix(l, "DONE ") || strings.HasPrefix(l, "refused ") {
			tried++
		}
	}
	assert.NotContains(t, a.Output(), "cannot read the channel", "the attacker is a reader of the channel")
	assert.GreaterOrEqual(t, tried, min, "attacks tried")
	return done
}

// TestOtherUidCannotChangeTheSegment: a member of the channel's group may
// attach and read (test below), but not change a descriptor or payload
// byte nor truncate the file. Before: the file was 0660, the member opened
// it read-write, scribbled over slots and payload and truncated it: the
// producer died of SIGBUS and the reader read garbage.
func TestOtherUidCannotChangeTheSegment(t *testing.T) {
	testkit.NeedRoot(t)
	exe := testkit.ExecutableForOthers(t)
	name := channel(t)
	const n = 300
	prod := startIsolation(t, exe, -1, "producer", "producer", name, strconv.Itoa(n), "4")
	prod.waitLine(t, "producer created", 30*time.Second)
	honest := startReader(t, name, readerSpec{lang: "c", expected: n}, "honest reader")
	v := startIsolation(t, exe, testkit.Nobody, "vandal (nobody, in the group)", "vandal", name, "2")

	assert.Empty(t, attackerResult(t, v, 6), "a reader of another uid changed the segment")
	assert.Equal(t, 0, honest.wait(t, 60*time.Second), "honest reader: %s", honest.Output())
	r := honest.result(t)
	assert.Equal(t, uint64(n), r.Batches, "every batch, intact")
	assert.Equal(t, 0, prod.wait(t, 60*time.Second), "the producer survived: %s", prod.Output())
	assert.Contains(t, prod.Output(), fmt.Sprintf("producer published %d", n))
	st, err := os.Stat(ring.ChannelPath(name))
	if err == nil {
		assert.Equal(t, os.FileMode(0o640), st.Mode().Perm())
	}
}

// TestOtherUidCannotReachAnotherReader: a member of the group cannot
// change another reader's cursor or claim, wherever it looks for them.
// Before: the reader area was a writable part of the segment; pushing
// every cursor far ahead let the producer overwrite the batches a slow
// reader held (it read garbage, or saw them overwritten).
func TestOtherUidCannotReachAnotherReader(t *testing.T) {
	testkit.NeedRoot(t)
	exe := testkit.ExecutableForOthers(t)
	name := channel(t)
	const n = 300
	prod := startIsolation(t, exe, -1, "producer", "producer", name, strconv.Itoa(n), "2")
	prod.waitLine(t, "producer created", 30*time.Second)
	victim := startReader(t, name, readerSpec{lang: "go", expected: n, slowUs: 1000}, "victim (holds each batch 1 ms)")
	time.Sleep(200 * time.Millisecond) // attached (the producer waits for it)
	pids := []string{strconv.Itoa(prod.cmd.Process.Pid), strconv.Itoa(victim.cmd.Process.Pid)}
	a := startIsolation(t, exe, testkit.Nobody, "reacher (nobody, in the group)",
		append([]string{"reach", name, "3"}, pids...)...)

	assert.Empty(t, attackerResult(t, a, 6), "a reader of another uid reached another reader's record")
	assert.Equal(t, 0, victim.wait(t, 60*time.Second), "victim: %s", victim.Output())
	r := victim.result(t)
	assert.Equal(t, uint64(n), r.Batches, "the victim read every batch, intact")
	assert.Equal(t, 0, prod.wait(t, 60*time.Second), "producer: %s", prod.Output())
}

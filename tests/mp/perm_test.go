package mp

// Permissions and names: a channel is private to its user unless the
// producer shares it with a group; another user can neither read it nor
// take its name; names cannot leave /dev/shm; a symbolic link planted at a
// channel's path is never followed. The other user is a child process
// running as nobody (uid 65534), which needs root to start.

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"

	"github.com/tsock/tsock/internal/batchgen"
	"github.com/tsock/tsock/internal/testkit"
	"github.com/tsock/tsock/producer"
	"github.com/tsock/tsock/reader"
	"github.com/tsock/tsock/ring"
)

// sharedGid is the group the group-sharing tests use: any number works
// for the kernel's checks, it need not exist in /etc/group.
const sharedGid = 64123

// TestHelperPerm is a child process: ACTION ARGS..., one result line.
//
//	attach NAME N    attach, read N test batches, "attach ok batches=N"
//	create NAME      become NAME's producer, "create ok"
//	open PATH        open read-only, "open ok"
//	remove PATH      unlink, "remove ok"
//
// Failures print "<action> failed: <status>: <message>".
func TestHelperPerm(t *testing.T) {
	if os.Getenv(envRole) != "perm" {
		t.Skip("helper process")
	}
	args := strings.Fields(os.Getenv(envArgs))
	fail := func(err error) {
		fmt.Printf("%s failed: %s: %v\n", args[0], statusName(err), err)
		os.Exit(0)
	}
	switch args[0] {
	case "attach":
		n, _ := strconv.ParseUint(args[2], 10, 64)
		r, err := reader.Attach(args[1], reader.Options{})
		if err != nil {
			fail(err)
		}
		c := batchgen.NewChecker()
		for c.Batches < n {
			b, err := r.Acquire(10 * time.Second)
			if err != nil || b == nil {
				fail(fmt.Errorf("acquire: %v", err))
			}
			if err := c.Data(tensors(b), b.Meta); err != nil {
				fail(err)
			}
			r.Release(b)
		}
		r.Detach()
		fmt.Printf("attach ok batches=%d first=%d\n", c.Batches, c.First)
	case "create":
		p, err := producer.Create(args[1], producer.Options{Slots: 2, SlotBytes: 4096})
		if err != nil {
			fail(err)
		}
		p.Close()
		fmt.Println("create ok")
	case "open":
		f, err := os.Open(args[1])
		if err != nil {
			fail(err)
		}
		f.Close()
		fmt.Println("open ok")
	case "remove":
		if err := os.Remove(args[1]); err != nil {
			fail(err)
		}
		fmt.Println("remove ok")
	}
	os.Exit(0)
}

// asUser runs TestHelperPerm as uid/gid with groups and returns its line.
func asUser(t *testing.T, exe string, uid, gid uint32, groups []uint32, args ...string) string {
	t.Helper()
	cmd := exec.Command(exe, "-test.run=^TestHelperPerm$")
	cmd.Env = append(os.Environ(), envRole+"=perm", envArgs+"="+strings.Join(args, " "))
	cmd.SysProcAttr = testkit.AsUser(uid, gid, groups...)
	cmd.Dir = "/"
	out, err := cmd.CombinedOutput()
	require.NoError(t, err, "%s", out)
	for _, l := range strings.Split(string(out), "\n") {
		if strings.HasPrefix(l, args[0]+" ") {
			return l
		}
	}
	t.Fatalf("no result line from %v as uid %d:\n%s", args, uid, out)
	return ""
}

// publishN publishes test batches 0..n-1 in the background once a reader
// is attached, waiting for it each time; it stops at the producer's close.
func publishN(p *producer.Producer, n uint64) {
	go func() {
		if p.WaitReaders(1, 30*time.Second) != nil {
			return
		}
		for i := uint64(0); i < n; i++ {
			for {
				_, err := publish(p, i, 100*time.Millisecond)
				if err == nil {
					break
				}
				if !errors.Is(err, producer.ErrTimedOut) {
					return
				}
			}
		}
	}()
}

func TestPermPrivateChannel(t *testing.T) {
	testkit.NeedRoot(t)
	exe := testkit.ExecutableForOthers(t)
	name := channel(t)
	p := create(t, name, producer.Options{Slots: 4, SlotBytes: 64 << 10})
	st, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o600), st.Mode().Perm(), "private by default")

	line := asUser(t, exe, testkit.Nobody, testkit.Nobody, nil, "attach", name, "1")
	assert.Contains(t, line, "attach failed: TSOCK_STATUS("+strconv.Itoa(ring.StatusPerm)+")")
	assert.Contains(t, line, "Permission denied")
	assert.Contains(t, line, ring.ChannelPath(name), "the message names the file")
	line = asUser(t, exe, testkit.Nobody, testkit.Nobody, nil, "open", ring.ChannelPath(name))
	assert.Contains(t, line, "open failed", "not even readable")

	// Nobody can take the name or remove the file ("/dev/shm" is sticky).
	line = asUser(t, exe, testkit.Nobody, testkit.Nobody, nil, "create", name)
	assert.Contains(t, line, "create failed: TSOCK_STATUS("+strconv.Itoa(ring.StatusPerm)+")")
	line = asUser(t, exe, testkit.Nobody, testkit.Nobody, nil, "remove", ring.ChannelPath(name))
	assert.Contains(t, line, "remove failed")

	// The channel is untouched: a reader of the owner still works.
	r := attach(t, name, reader.Options{})
	_, err = publish(p, 0, time.Second)
	require.NoError(t, err)
	b, err := r.Acquire(time.Second)
	require.NoError(t, err)
	require.NotNil(t, b)
	assert.Len(t, p.Readers(), 1)

	// Even a dead owner's channel is not taken over by another user.
	p.Close()
	dead := channel(t)
	staleOwned(t, dead)
	line = asUser(t, exe, testkit.Nobody, testkit.Nobody, nil, "create", dead)
	assert.Contains(t, line, "create failed")
	_, err = os.Stat(ring.ChannelPath(dead))
	assert.NoError(t, err, "the dead channel is left for its owner")
}

// staleOwned leaves a valid segment with no live producer at name.
func staleOwned(t *testing.T, name string) {
	t.Helper()
	p, err := producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
	require.NoError(t, err)
	// Keep the file, drop the lock: link it to the name again after close.
	tmp := ring.ChannelPath(name + "-keep")
	require.NoError(t, os.Link(ring.ChannelPath(name), tmp))
	require.NoError(t, p.Close())
	require.NoError(t, os.Rename(tmp, ring.ChannelPath(name)))
	// A closed segment is not dead; make it look killed: state open again.
	f, err := os.OpenFile(ring.ChannelPath(name), os.O_RDWR, 0)
	require.NoError(t, err)
	defer f.Close()
	b := make([]byte, 4)
	b[0] = byte(ring.StateOpen)
	_, err = f.WriteAt(b, int64(ring.HeaderOffState))
	require.NoError(t, err)
}

func TestPermGroupShared(t *testing.T) {
	testkit.NeedRoot(t)
	exe := testkit.ExecutableForOthers(t)
	name := channel(t)
	p := create(t, name, producer.Options{Slots: 4, SlotBytes: batchgen.MaxPayload, Mode: 0o660, Gid: sharedGid})
	st, err := os.Stat(ring.ChannelPath(name))
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o640), st.Mode().Perm(), "readers only read: the group gets no write bit")
	assert.Equal(t, uint32(sharedGid), st.Sys().(*syscall.Stat_t).Gid)

	// Not in the group: refused.
	line := asUser(t, exe, testkit.Nobody, testkit.Nobody, nil, "attach", name, "1")
	assert.Contains(t, line, "attach failed: TSOCK_STATUS("+strconv.Itoa(ring.StatusPerm)+")")

	// In the group (as a supplementary group): reads every batch.
	publishN(p, 20)
	line = asUser(t, exe, testkit.Nobody, testkit.Nobody, []uint32{sharedGid}, "attach", name, "20")
	assert.Equal(t, "attach ok batches=20 first=0", line)

	// Readers need only read the segment: 0640 is as good as 0660.
	ro := channel(t)
	p2 := create(t, ro, producer.Options{Slots: 2, SlotBytes: batchgen.MaxPayload, Mode: 0o640, Gid: sharedGid})
	publishN(p2, 3)
	line = asUser(t, exe, testkit.Nobody, testkit.Nobody, []uint32{sharedGid}, "attach", ro, "3")
	assert.Equal(t, "attach ok batches=3 first=0", line)
	line = asUser(t, exe, testkit.Nobody, testkit.Nobody, []uint32{sharedGid}, "open", ring.ChannelPath(ro))
	assert.Equal(t, "open ok", line, "and inspect it")
}

func TestNamesStayInShm(t *testing.T) {
	outside := fmt.Sprintf("/dev/tsock-escape-%d", os.Getpid())
	t.Cleanup(func() { os.Remove(outside) })
	for _, bad := range []string{"", ".", "..", "/", "a/b", "../tsock-escape-" + strconv.Itoa(os.Getpid()),
		"../../etc/passwd", "/etc/passwd", "x\x00y", "a\\b", strings.Repeat("n", 65)} {
		_, err := producer.Create(bad, producer.Options{Slots: 2, SlotBytes: 4096})
		assert.Equal(t, ring.StatusName, ring.StatusOf(err), "create %q: %v", bad, err)
		_, err = reader.Attach(bad, reader.Options{})
		assert.Equal(t, ring.StatusName, ring.StatusOf(err), "attach %q: %v", bad, err)
		_, err = ring.OpenSegment(bad)
		assert.Equal(t, ring.StatusName, ring.StatusOf(err), "open %q: %v", bad, err)
	}
	_, err := os.Lstat(outside)
	assert.ErrorIs(t, err, os.ErrNotExist, "nothing created outside /dev/shm")
}

// TestSymlinkNotFollowed plants links at channel paths (as another user
// could: /dev/shm is world-writable, and this machine may not set
// fs.protected_symlinks): to a live channel, to a file of the producer's
// user elsewhere. Nothing follows them.
func TestSymlinkNotFollowed(t *testing.T) {
	real := channel(t)
	p := create(t, real, producer.Options{Slots: 2, SlotBytes: 4096})
	link := channel(t)
	require.NoError(t, os.Symlink(ring.ChannelPath(real), ring.ChannelPath(link)))

	_, err := reader.Attach(link, reader.Options{})
	require.Error(t, err, "attach through a link")
	assert.Contains(t, err.Error(), ring.ChannelPath(link))
	assert.Contains(t, err.Error(), "symbolic link; not followed")
	assert.Empty(t, p.Readers(), "no record claimed in the link's target")
	_, err = reader.Attach(link, reader.Options{AttachTimeout: 50 * time.Millisecond})
	require.Error(t, err)

	// A producer of the link's name neither writes through it nor removes
	// the target; it reports the file in its way.
	victim := t.TempDir() + "/victim"
	require.NoError(t, os.WriteFile(victim, []byte("precious"), 0o644))
	link2 := channel(t)
	require.NoError(t, os.Symlink(victim, ring.ChannelPath(link2)))
	for _, name := range []string{link, link2} {
		_, err = producer.Create(name, producer.Options{Slots: 2, SlotBytes: 4096})
		require.Error(t, err, "create %s over a link", name)
		assert.Contains(t, err.Error(), ring.ChannelPath(name))
		assert.Contains(t, err.Error(), "symbolic link; not followed")
		fi, err := os.Lstat(ring.ChannelPath(name))
		require.NoError(t, err)
		assert.NotZero(t, fi.Mode()&os.ModeSymlink, "the link itself is left for a person to look at")
	}
	b, err := os.ReadFile(victim)
	require.NoError(t, err)
	assert.Equal(t, "precious", string(b))
	st, err := os.Stat(victim)
	require.NoError(t, err)
	assert.Equal(t, os.FileMode(0o644), st.Mode().Perm())
	_, err = publish(p, 0, time.Second)
	require.NoError(t, err, "the real channel still works")
}

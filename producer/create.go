package producer

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/tsock/tsock/internal/readers"
	"github.com/tsock/tsock/ring"
)

// shmDir is where channels are made: ring.ShmDir, which readers and tools
// also use. Only tests point it elsewhere (a small tmpfs, export_test.go).
var shmDir = ring.ShmDir

// channelPath is the segment file of channel name.
func channelPath(name string) string { return shmDir + "/" + ring.ShmPrefix + name }

// checkFree is the early statfs check of reserveSpace; tests turn it off to
// reach the fallocate path.
var checkFree = true

// fallocChunk is how much reserveSpace allocates per fallocate call: a
// call interrupted by a signal (EINTR, on kernels that abort tmpfs
// fallocate on any signal, and the Go runtime preempts with signals) then
// repeats one chunk, not the whole segment.
const fallocChunk = 64 << 20

// reserveSpace sizes the segment file to size bytes and allocates every
// page of it now. A tmpfs file is sparse: a segment that does not fit
// would be created fine and kill the producer or a reader with SIGBUS at
// the first touch of a page the filesystem cannot supply (PyTorch's most
// reported shared-memory failure). Reserving makes the segment's memory
// committed from creation on, and turns "does not fit" into an error
// here, naming the sizes.
func reserveSpace(f *os.File, name string, size uint64) error {
	fd := int(f.Fd())
	if checkFree {
		if free, total, ok := fsFree(fd); ok && size > free {
			return spaceError(name, size, free, total, nil)
		}
	}
	if err := f.Truncate(int64(size)); err != nil {
		return sysError(err, "size channel %q to %d bytes", name, size)
	}
	for off := uint64(0); off < size; {
		n := min(size-off, fallocChunk)
		err := unix.Fallocate(fd, 0, int64(off), int64(n))
		switch {
		case err == nil:
			off += n
		case errors.Is(err, unix.EINTR):
			// retry the chunk
		case errors.Is(err, unix.EOPNOTSUPP):
			// Not tmpfs (tmpfs has fallocate since Linux 3.5): the file
			// stays sparse, and only the statfs check above stood
			// between a segment too big and SIGBUS.
			return nil
		case errors.Is(err, unix.ENOSPC):
			free, total, _ := fsFree(fd)
			return spaceError(name, size, free, total, err)
		default:
			return sysError(err, "reserve %d bytes for channel %q", size, name)
		}
	}
	return nil
}

// fsFree is the space an unprivileged user may still allocate in the
// filesystem of fd, and its size.
func fsFree(fd int) (free, total uint64, ok bool) {
	var st unix.Statfs_t
	if unix.Fstatfs(fd, &st) != nil {
		return 0, 0, false
	}
	return st.Bavail * uint64(st.Bsize), st.Blocks * uint64(st.Bsize), true
}

func spaceError(name string, size, free, total uint64, err error) error {
	why := ""
	if err != nil {
		why = fmt.Sprintf(" (%v)", err)
	}
	return ring.Errorf(ring.StatusNoMem,
		"channel %q needs %d bytes (%s) in %s, which has %d bytes (%s) free of %d (%s)%s%s: "+
			"lower Slots or SlotBytes, remove dead channels (tsock rm --all-dead) and unused caches "+
			"(tsock rm --caches), or enlarge %s (docker run --shm-size)",
		name, size, mib(size), shmDir, free, mib(free), total, mib(total), why, cachesNote(), shmDir)
}

// cachesNote says how much of shmDir the decoded-sample caches of
// tsock.Pipeline take (files tsock-cache.*, every user's), "" if none: a
// full /dev/shm is often theirs.
func cachesNote() string {
	ents, err := os.ReadDir(shmDir)
	if err != nil {
		return ""
	}
	n, bytes := 0, uint64(0)
	for _, e := range ents {
		if !strings.HasPrefix(e.Name(), "tsock-cache.") {
			continue
		}
		if info, err := e.Info(); err == nil {
			if st, ok := info.Sys().(*syscall.Stat_t); ok {
				bytes += uint64(st.Blocks) * 512
			}
		}
		n++
	}
	if n == 0 {
		return ""
	}
	return fmt.Sprintf("; %d decoded-sample caches take %s of it", n, mib(bytes))
}

func mib(n uint64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }

// segmentMode is the file mode of a segment for the mode asked: readers
// only read it, so group and others never get write permission (a reader
// that could write the file could change descriptors and payload, or
// truncate it under the producer).
func segmentMode(asked os.FileMode) os.FileMode { return asked &^ 0o022 }

// buildSegment creates the segment as an unnamed file (createUnnamed),
// fully initialised and locked before install gives it its name, so that
// no reader can ever open a half-built channel and a producer killed while
// creating leaves nothing behind. With a device, the device pool is made
// and described in the segment before the header is published; the join
// socket is bound and its key written there too.
func buildSegment(name string, g ring.Geometry, opts Options) (*ring.Segment, string, *devicePool, *readers.Table, error) {
	f, tmp, err := createUnnamed()
	if err != nil {
		return nil, "", nil, nil, err
	}
	where := tmp
	if where == "" {
		where = "the new segment of " + name
	}
	fail := func(err error) (*ring.Segment, string, *devicePool, *readers.Table, error) {
		closeLockable(f)
		if tmp != "" {
			os.Remove(tmp)
		}
		return nil, "", nil, nil, err
	}
	if err := reserveSpace(f, name, g.TotalBytes); err != nil {
		return fail(err)
	}
	// Mapped while the file is still 0600: the mapping comes from a second
	// open (ring.MapSegment), which a mode without owner write would refuse.
	seg, err := ring.MapSegment(f, g, opts.Slots, opts.MaxReaders, true)
	if err != nil {
		return fail(sysError(err, "map %s", where))
	}
	failMapped := func(err error) (*ring.Segment, string, *devicePool, *readers.Table, error) {
		seg.Unmap()
		return fail(err)
	}
	if err := f.Chmod(segmentMode(opts.Mode)); err != nil { // the umask must not widen or narrow the choice
		return failMapped(sysError(err, "chmod %s", where))
	}
	if opts.Gid > 0 {
		if err := f.Chown(-1, opts.Gid); err != nil {
			return failMapped(sysError(err, "chown %s to group %d", where, opts.Gid))
		}
	}
	seg.SetJoinWindow(uint64(opts.JoinWindow))
	var pool *devicePool
	if ordinal, _ := ParseDevice(opts.Device); ordinal >= 0 {
		if pool, err = openPool(ordinal, seg); err != nil {
			return failMapped(err)
		}
	}
	table, err := readers.Listen(seg, guard())
	if err != nil {
		pool.close()
		return failMapped(sysError(err, "channel %q", name))
	}
	seg.InitHeader(name, os.Getpid(), uint64(time.Now().UnixNano()))
	if err := ring.LockByte(f, ring.LockProducer); err != nil {
		table.Close()
		pool.close()
		return failMapped(sysError(err, "lock %s", where))
	}
	return seg, tmp, pool, table, nil
}

// createUnnamed makes the segment's file in shmDir without a name
// (O_TMPFILE): it exists only through its descriptor until install links
// it, so if the producer dies first, the kernel frees it with the
// descriptor. Where O_TMPFILE is not supported (Linux before 3.11, or a
// filesystem without it; tmpfs has it) it falls back to a hidden temporary
// name, returned as tmp, which a producer killed before install leaves
// behind (tsock rm removes those of dead processes).
func createUnnamed() (f *os.File, tmp string, err error) {
	err = unix.EOPNOTSUPP
	if useTmpfile {
		f, err = openLockable(func() (*os.File, error) {
			return os.OpenFile(shmDir, os.O_RDWR|unix.O_TMPFILE, 0o600)
		})
	}
	if err == nil {
		return f, "", nil
	}
	if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EISDIR) && !errors.Is(err, unix.EINVAL) {
		return nil, "", sysError(err, "create an unnamed file in %s", shmDir)
	}
	var rnd [6]byte
	_, _ = rand.Read(rnd[:])
	tmp = fmt.Sprintf("%s/.tsock-tmp.%d.%s", shmDir, os.Getpid(), hex.EncodeToString(rnd[:]))
	f, err = openLockable(func() (*os.File, error) {
		return os.OpenFile(tmp, os.O_RDWR|os.O_CREATE|os.O_EXCL|syscall.O_NOFOLLOW, 0o600)
	})
	if err != nil {
		return nil, "", sysError(err, "create %s", tmp)
	}
	return f, tmp, nil
}

// useTmpfile is false only in tests of the fallback.
var useTmpfile = true

// link gives the built segment the channel's name; like link(2) it fails
// with EEXIST when the name exists. An unnamed file is linked through
// /proc/self/fd (linkat with AT_SYMLINK_FOLLOW: AT_EMPTY_PATH would need
// CAP_DAC_READ_SEARCH).
func (p *Producer) link() error {
	if p.tmp != "" {
		return os.Link(p.tmp, p.path)
	}
	src := "/proc/self/fd/" + strconv.Itoa(int(p.seg.File.Fd()))
	if err := unix.Linkat(unix.AT_FDCWD, src, unix.AT_FDCWD, p.path, unix.AT_SYMLINK_FOLLOW); err != nil {
		return &os.LinkError{Op: "linkat", Old: src, New: p.path, Err: err}
	}
	return nil
}

// install links the built segment at the channel's name. If a segment is
// already there, its producer lock tells whether its owner lives: a live
// owner is an error, a dead one's segment is removed (its readers then see
// "producer gone").
func (p *Producer) install() error {
	if p.tmp != "" {
		defer os.Remove(p.tmp)
	}
	for attempt := 0; attempt < 100; attempt++ {
		err := p.link()
		if err == nil {
			return nil
		}
		if !errors.Is(err, os.ErrExist) {
			return sysError(err, "link %s", p.path)
		}
		if err := reclaimStale(p.path); err != nil {
			return err
		}
	}
	return ring.Errorf(ring.StatusExist, "channel %q: kept losing the race to create it", p.name)
}

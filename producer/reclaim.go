package producer

import (
	"encoding/binary"
	"errors"
	"os"
	"strings"
	"syscall"
	"time"

	"github.com/tsock/tsock/ring"
)

// Dead channels: a producer that dies leaves its segment named in
// /dev/shm (its readers may still be reading what it published). Sweeps
// with generated names would pile them up, so each Create removes the
// channels of the same user that nobody holds any more: no producer lock,
// no reader lock (a live reader may still drain the batches left), and no
// sign of life for reclaimGrace. Others are left to `tsock rm`.

// reclaimGrace keeps a dead channel named for a while after its last sign
// of life (the file's modification time, set when it was created, and the
// producer's last publish): a reader or a tool that looks just after the
// producer died still finds it and reports "producer gone", not "no such
// channel".
const reclaimGrace = 30 * time.Second

// reclaimDead removes the dead channels of this user in shmDir, except
// channel keep (the caller's). Best effort: anything unexpected is left.
func reclaimDead(keep string) {
	ents, err := os.ReadDir(shmDir)
	if err != nil {
		return
	}
	uid := uint32(os.Geteuid())
	for _, e := range ents {
		n, ok := strings.CutPrefix(e.Name(), ring.ShmPrefix)
		if !ok || n == keep || !ring.NameOK(n) || !e.Type().IsRegular() {
			continue
		}
		reclaimIfDead(channelPath(n), uid)
	}
}

// reclaimIfDead removes the segment at path if it is this user's, a tsock
// segment, and held by nobody, and reports whether it did.
func reclaimIfDead(path string, uid uint32) bool {
	st, err := os.Lstat(path)
	if err != nil || !st.Mode().IsRegular() || !ownedBy(st, uid) || time.Since(st.ModTime()) < reclaimGrace {
		return false
	}
	f, err := openLockable(func() (*os.File, error) {
		return os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	})
	if err != nil {
		return false
	}
	defer closeLockable(f)
	if !sameFile(f, st) {
		return false
	}
	// Look before taking any lock: while we hold a segment's producer lock
	// it looks alive to everyone, so take it only on a likely candidate.
	if held, err := ring.RangeLocked(f, ring.LockProducer, 0); err != nil || held {
		return false // a live producer, or a live reader
	}
	if !quiet(f) {
		return false
	}
	// Holding the producer lock keeps any other producer from taking the
	// file, and makes a Create of this very name wait (lockStale) until
	// the name is gone. Then look again: a reader may have come meanwhile.
	if ring.LockByte(f, ring.LockProducer) != nil {
		return false // a live producer (or another reclaimer)
	}
	if held, err := ring.RangeLocked(f, ring.LockReader0, 0); err != nil || held {
		return false // a live reader: it may still be reading the batches left
	}
	// The path must still name this file: it cannot change while we hold
	// the lock (a Create of this name waits for it, and only a process
	// holding a dead segment's lock removes it), unless someone removes it
	// by hand.
	cur, err := os.Lstat(path)
	if err != nil || !sameFile(f, cur) {
		return false
	}
	return os.Remove(path) == nil
}

// quiet reports whether f is a tsock segment that published nothing for
// reclaimGrace, from a private copy of its header (only the magic and the
// last publish are used).
func quiet(f *os.File) bool {
	hdr := make([]byte, ring.HeaderSize)
	if n, _ := f.ReadAt(hdr, 0); n < len(hdr) || !looksLikeSegment(hdr) {
		return false // not ours to judge: tsock rm --force
	}
	if hb := binary.LittleEndian.Uint64(hdr[ring.HeaderOffHeartbeatNs:]); hb != 0 {
		if now := ring.MonotonicNs(); now > hb && time.Duration(now-hb) < reclaimGrace {
			return false
		}
	}
	return true
}

func ownedBy(st os.FileInfo, uid uint32) bool {
	sys, ok := st.Sys().(*syscall.Stat_t)
	return ok && sys.Uid == uid
}

// reclaimStale removes the segment at path if its producer is dead. It
// returns nil when the path is free to try again.
func reclaimStale(path string) error {
	f, err := openLockable(func() (*os.File, error) { return os.OpenFile(path, os.O_RDWR|syscall.O_NOFOLLOW, 0) })
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if errors.Is(err, syscall.ELOOP) {
		return ring.Errorf(ring.StatusCorrupt, "%s is a symbolic link; not followed (remove it by hand)", path)
	}
	if err != nil {
		return sysError(err, "open existing %s", path)
	}
	defer closeLockable(f)
	if err := lockStale(f, path); err != nil {
		return err
	}
	// We hold the dead producer's lock. Make sure the path still names this
	// file (another producer may have replaced it meanwhile), then remove it.
	var a, b syscall.Stat_t
	if syscall.Fstat(int(f.Fd()), &a) != nil || syscall.Stat(path, &b) != nil || a.Ino != b.Ino || a.Dev != b.Dev {
		return nil
	}
	// Producers link only finished segments, so anything without the magic
	// is not ours: leave it for a person to look at.
	buf := make([]byte, 8)
	if n, _ := f.ReadAt(buf, 0); n < len(buf) || !looksLikeSegment(buf) {
		return ring.Errorf(ring.StatusCorrupt, "%s is not a tsock segment; remove it by hand", path)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return sysError(err, "remove stale %s", path)
	}
	return nil
}

// lockStale takes the producer lock of the segment f, opened at path. The
// lock is held either by a live producer, or for a moment by a process
// reclaiming this dead segment (reclaimDead, at another channel's Create),
// which then removes the name: so a held lock is given up to 50 ms to go
// away or the name to change (nil error, lock not taken: the caller's
// check that path still names f then sends it round again) before it
// counts as a live producer. The 50 ms run from the first look and end with
// a look taken after them: a Create descheduled between two looks (a
// loaded machine) still looks again rather than give up on a stale view.
// A read lock there (any reader of the file may take one) is no producer,
// but it keeps the write lock from us: the error says so, and that tsock
// rm removes the file.
func lockStale(f *os.File, path string) error {
	var deadline time.Time
	for {
		looked := time.Now()
		err := ring.LockByte(f, ring.LockProducer)
		if err == nil {
			return nil
		}
		if err != ring.ErrLocked {
			return sysError(err, "lock %s", path)
		}
		if st, err := os.Lstat(path); err != nil || !sameFile(f, st) {
			return nil
		}
		if staleLockedHook != nil {
			staleLockedHook()
		}
		if deadline.IsZero() {
			deadline = looked.Add(50 * time.Millisecond)
		}
		if looked.After(deadline) {
			if alive, err := ring.ByteWriteLocked(f, ring.LockProducer); err == nil && !alive {
				return ring.Errorf(ring.StatusExist, "%s: its producer is dead, but a reader process holds a read "+
					"lock on its producer byte (a broken or hostile reader); `tsock rm` removes the file", path)
			}
			return ring.Errorf(ring.StatusExist, "%s has a live producer", path)
		}
		time.Sleep(time.Millisecond)
	}
}

// staleLockedHook, set by tests only, runs each time lockStale has found
// the lock held, before it decides to look again or give up.
var staleLockedHook func()

// sameFile reports whether f is the file st describes.
func sameFile(f *os.File, st os.FileInfo) bool {
	fst, err := f.Stat()
	return err == nil && os.SameFile(fst, st)
}

func looksLikeSegment(hdr []byte) bool {
	var m uint64
	for i := 7; i >= 0; i-- {
		m = m<<8 | uint64(hdr[i])
	}
	return m == ring.Magic
}

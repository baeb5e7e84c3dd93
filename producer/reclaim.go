package producer

import (
	"encoding/binary"
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

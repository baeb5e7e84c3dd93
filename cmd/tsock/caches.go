package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"syscall"

	"github.com/tsock/tsock/ring"
)

// The decoded-sample caches of tsock.Pipeline(cache_bytes=...): one file
// per cache, /dev/shm/tsock-cache.UID.KEY (or KEY.N when another uid's file
// sat at that name). python/tsock/_cache_segment.py defines them; the
// tools need only the name and the byte every process using a cache holds
// a read lock on (USERS_BYTE there). tests/python/test_cli_caches.py checks
// both against a live cache.
const (
	cachePrefix    = "tsock-cache."
	cacheUsersByte = 1
)

// cacheFile is a decoded-sample cache segment in /dev/shm.
type cacheFile struct {
	Path  string `json:"path"`
	UID   int    `json:"uid"`
	Bytes uint64 `json:"bytes"`  // allocated (the file is fallocated whole)
	InUse bool   `json:"in_use"` // a process has it open
	Error string `json:"error,omitempty"`
}

// cacheUID is the uid in a cache file's name (tsock-cache.UID.KEY, KEY 32
// lowercase hex digits, then maybe .N), or -1 if the name is not a
// cache's. Anyone can create files in /dev/shm: a name that is not exactly
// a cache's is not listed, so no byte of it reaches a terminal (review 35,
// E1: escape sequences and newlines did).
func cacheUID(name string) int {
	rest, ok := strings.CutPrefix(name, cachePrefix)
	if !ok {
		return -1
	}
	uidText, key, ok := strings.Cut(rest, ".")
	uid, err := strconv.Atoi(uidText)
	if !ok || err != nil || uid < 0 || uidText != strconv.Itoa(uid) {
		return -1
	}
	key, fallback, hasFallback := strings.Cut(key, ".")
	if len(key) != 32 || strings.Trim(key, "0123456789abcdef") != "" {
		return -1
	}
	if hasFallback && (len(fallback) != 1 || fallback < "1" || fallback > "7") {
		return -1
	}
	return uid
}

// listCaches returns the cache segments in dir, of every uid, without
// changing anything: a file this user may not open is listed with why.
func listCaches(dir string) ([]cacheFile, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	out := []cacheFile{}
	for _, e := range ents {
		uid := cacheUID(e.Name())
		if uid < 0 || !e.Type().IsRegular() {
			continue
		}
		c := cacheFile{Path: filepath.Join(dir, e.Name()), UID: uid}
		if err := c.inspect(); err != nil {
			c.Error = err.Error()
		}
		out = append(out, c)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Path < out[j].Path })
	return out, nil
}

// openCache opens a cache file without following a link or blocking on
// a FIFO, and stats what it opened.
func openCache(path string, flag int) (*os.File, syscall.Stat_t, error) {
	var st syscall.Stat_t
	f, err := os.OpenFile(path, flag|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, st, err
	}
	if err := syscall.Fstat(int(f.Fd()), &st); err != nil {
		f.Close()
		return nil, st, err
	}
	return f, st, nil
}

// inspect fills in the size and whether a process uses the cache.
func (c *cacheFile) inspect() error {
	f, st, err := openCache(c.Path, os.O_RDONLY)
	if err != nil {
		return err
	}
	defer f.Close()
	c.UID = int(st.Uid) // the owner, whatever the name says
	c.Bytes = uint64(st.Blocks) * 512
	c.InUse, err = ring.ByteLocked(f, cacheUsersByte)
	return err
}

// removeCache unlinks a cache segment of this user that no process uses.
// The users lock is taken for writing while the file is unlinked, so a
// process cannot open it in between (it takes a read lock there first),
// and the path must still name the file that was locked.
func removeCache(path string) error {
	f, st, err := openCache(path, os.O_RDWR)
	if err != nil {
		return err
	}
	defer f.Close()
	if int(st.Uid) != os.Geteuid() {
		return fmt.Errorf("owned by uid %d: only its owner removes it", st.Uid)
	}
	if err := ring.LockByte(f, cacheUsersByte); err != nil {
		if errors.Is(err, ring.ErrLocked) {
			return errors.New("in use by a running process")
		}
		return err
	}
	defer func() { _ = ring.UnlockByte(f, cacheUsersByte) }()
	now, err := os.Lstat(path)
	if err != nil {
		return err
	}
	if !os.SameFile(now, mustStat(f)) {
		return errors.New("replaced while looking at it; try again")
	}
	return os.Remove(path)
}

// printCaches is ls's section on caches.
func printCaches(w io.Writer, caches []cacheFile) {
	if len(caches) == 0 {
		return
	}
	var total uint64
	unused := 0
	for _, c := range caches {
		total += c.Bytes
		if !c.InUse && c.Error == "" {
			unused++
		}
	}
	fmt.Fprintf(w, "\n%d decoded-sample caches in /dev/shm, %s (%d unused; 'tsock rm --caches' removes this user's unused ones):\n",
		len(caches), humanBytes(total), unused)
	for _, c := range caches {
		state := "unused"
		switch {
		case c.Error != "":
			state = c.Error
		case c.InUse:
			state = "in use"
		}
		fmt.Fprintf(w, "  %s (uid %d, %s, %s)\n", c.Path, c.UID, humanBytes(c.Bytes), state)
	}
}

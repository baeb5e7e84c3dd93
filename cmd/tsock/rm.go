package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"syscall"

	"github.com/tsock/tsock/ring"
)

func init() {
	register(&command{
		name:    "rm",
		args:    "[NAME...]",
		summary: "remove stale channels whose producer is dead, and leftover temporary files",
		help: `Removes channel NAME (/dev/shm/tsock.NAME) when its producer is dead (no
process holds the producer lock) or it was closed. A channel with a live
producer is never removed: stop the producer, or let it close the channel.
Readers still attached to a removed channel keep their mapping and report
"producer gone"; the memory is freed when the last of them detaches.

A file at a channel's path that is not a tsock segment (foreign, truncated,
another layout version) is left alone unless --force is given; a symbolic
link is never followed and never removed.

Every run also removes the producers' hidden temporary files
(/dev/shm/.tsock-tmp.PID.*, made only where O_TMPFILE is not supported)
whose creating process is gone.

Each producer's creation already removes its user's dead channels that no
reader holds and that showed no sign of life for 30 s; rm is for the rest
(another user's, one a reader still holds, one just dead, foreign files).

--all-dead removes every dead or closed channel instead of named ones
(those whose name matches --match, a glob, if given).

--caches also removes this user's decoded-sample caches
(/dev/shm/tsock-cache.UID.KEY, tsock.Pipeline(cache_bytes=...)) that no
process uses (those whose file name matches --match, if given); one in
use is left, and named on stderr.
Exit status: 0 when everything asked for was removed, 1 when something
was refused or missing, 2 for a bad command line.`,
		run:   runRm,
		flags: func() *flag.FlagSet { var o rmOptions; return o.flagSet(io.Discard) },
	})
}

type rmOptions struct {
	allDead bool
	match   string
	force   bool
	jsonOut bool
	caches  bool
}

func (o *rmOptions) flagSet(w io.Writer) *flag.FlagSet {
	fs := newFlagSet("rm", w)
	fs.BoolVar(&o.allDead, "all-dead", false, "remove every channel whose producer is dead")
	fs.StringVar(&o.match, "match", "*", "with --all-dead or --caches: only channels (cache files) whose name matches this glob")
	fs.BoolVar(&o.force, "force", false, "also remove a file without a live producer that is not a valid segment")
	fs.BoolVar(&o.jsonOut, "json", false, "print the result as JSON")
	fs.BoolVar(&o.caches, "caches", false, "also remove this user's decoded-sample caches that no process uses")
	return fs
}

// rmRefusal is a channel rm did not remove, and why.
type rmRefusal struct {
	Name   string `json:"name"`
	Reason string `json:"reason"`
}

// rmResult is the --json output of rm.
type rmResult struct {
	Removed     []string    `json:"removed"`
	Refused     []rmRefusal `json:"refused"`
	TempRemoved []string    `json:"temp_removed"`
	TempKept    []string    `json:"temp_kept"` // creator still alive
	Caches      []string    `json:"caches_removed"`
}

func runRm(e *env, args []string) int {
	var o rmOptions
	fs := o.flagSet(e.stderr)
	names, st, ok := parseInterspersed(fs, args)
	if !ok {
		return st
	}
	if len(names) == 0 && !o.allDead && !o.caches {
		fmt.Fprintf(e.stderr, "usage: tsock rm [--force] [--json] [--caches] NAME... | tsock rm --all-dead | tsock rm --caches\n")
		return exitUsage
	}
	if len(names) > 0 && o.allDead {
		fmt.Fprintf(e.stderr, "tsock rm: give channel names or --all-dead, not both\n")
		return exitUsage
	}
	res := rmResult{Removed: []string{}, Refused: []rmRefusal{}, TempRemoved: []string{}, TempKept: []string{},
		Caches: []string{}}
	if o.allDead {
		all, err := listChannels(o.match)
		if err != nil {
			fmt.Fprintf(e.stderr, "tsock rm: %v\n", err)
			return exitUsage
		}
		for _, n := range all {
			ci, err := inspectChannel(n)
			if err == nil && (ci.State == stateDead || ci.State == stateClosed) {
				names = append(names, n)
			}
		}
	}
	for _, n := range names {
		detail, err := removeChannel(n, o.force)
		if err != nil {
			res.Refused = append(res.Refused, rmRefusal{Name: n, Reason: err.Error()})
			if !o.jsonOut {
				fmt.Fprintf(e.stderr, "tsock rm: %s: %v\n", n, err)
			}
			continue
		}
		res.Removed = append(res.Removed, n)
		if !o.jsonOut {
			fmt.Fprintf(e.stdout, "removed %s (%s)\n", n, detail)
		}
	}
	tmps, err := listTempFiles(shmDir)
	if err != nil {
		fmt.Fprintf(e.stderr, "tsock rm: %v\n", err)
	}
	for _, t := range tmps {
		if t.Alive {
			res.TempKept = append(res.TempKept, t.Path)
			continue
		}
		if err := os.Remove(t.Path); err != nil && !errors.Is(err, os.ErrNotExist) {
			res.Refused = append(res.Refused, rmRefusal{Name: t.Path, Reason: err.Error()})
			if !o.jsonOut {
				fmt.Fprintf(e.stderr, "tsock rm: %v\n", err)
			}
			continue
		}
		res.TempRemoved = append(res.TempRemoved, t.Path)
		if !o.jsonOut {
			fmt.Fprintf(e.stdout, "removed %s (temporary file of dead pid %d)\n", t.Path, t.Pid)
		}
	}
	if o.caches {
		removeCaches(e, &res, o.match, o.jsonOut)
	}
	if o.jsonOut {
		_ = writeJSON(e.stdout, res)
	}
	if len(res.Refused) > 0 {
		return exitFail
	}
	return exitOK
}

// errLiveProducer says a channel still has its producer.
var errLiveProducer = errors.New("channel has a live producer")

// removeChannel unlinks channel name if no live producer holds it. It
// returns a description of what was removed, or why it was not.
func removeChannel(name string, force bool) (string, error) {
	if !ring.NameOK(name) {
		return "", fmt.Errorf("invalid channel name %q: names are 1..%d of [A-Za-z0-9._-]", name, ring.NameMax)
	}
	path := ring.ChannelPath(name)
	lst, err := os.Lstat(path)
	if errors.Is(err, os.ErrNotExist) {
		return "", fmt.Errorf("no channel %q (%s)", name, path)
	}
	if err != nil {
		return "", err
	}
	if lst.Mode()&os.ModeSymlink != 0 {
		return "", fmt.Errorf("%s is a symbolic link, not a tsock segment: tsock never follows or removes links; check it and remove it by hand", path)
	}
	if !lst.Mode().IsRegular() {
		return "", fmt.Errorf("%s is not a regular file (%s); remove it by hand", path, lst.Mode().Type())
	}
	// O_NOFOLLOW and a check that the path still names the file we looked
	// at: a file swapped in meanwhile is not removed.
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0)
	if err != nil {
		if sys, ok := lst.Sys().(*syscall.Stat_t); ok && errors.Is(err, os.ErrPermission) {
			return "", fmt.Errorf("%w: only its owner (uid %d) or root may remove it", err, sys.Uid)
		}
		return "", err
	}
	defer f.Close()
	// Only a write lock is a producer's: a reader may hold a read lock on
	// that byte (of a dead channel, to keep its name taken), which does not
	// keep the channel.
	locked, err := ring.ByteWriteLocked(f, ring.LockProducer)
	if err != nil {
		return "", fmt.Errorf("read the producer lock of %s: %w", path, err)
	}
	detail := ""
	seg, serr := ring.OpenSegment(name)
	if serr == nil {
		defer seg.Close()
		if !os.SameFile(mustStat(seg.File), mustStat(f)) {
			return "", fmt.Errorf("%s was replaced while looking at it; try again", path)
		}
		ci := channelInfo{Name: name}
		fillChannelInfo(&ci, seg)
		if locked && ci.State != stateClosed {
			return "", fmt.Errorf("%w (pid %d, %d readers): refusing to remove it; stop the producer or let it close the channel",
				errLiveProducer, ci.ProducerPid, ci.Readers)
		}
		detail = fmt.Sprintf("producer pid %d %s", ci.ProducerPid, map[string]string{stateDead: "dead", stateClosed: "closed the channel"}[ci.State])
		if ci.State == stateClosed && locked {
			detail = fmt.Sprintf("producer pid %d closed the channel", ci.ProducerPid)
		}
		if ci.Readers > 0 {
			detail += fmt.Sprintf("; %d readers still attached will see it end", ci.Readers)
		}
	} else {
		if locked {
			return "", fmt.Errorf("%w holding %s, which is not a valid segment (%v); refusing to remove it", errLiveProducer, path, serr)
		}
		if !force {
			return "", fmt.Errorf("%s is not a usable tsock segment (%v); use --force to remove it anyway", path, serr)
		}
		detail = fmt.Sprintf("not a valid segment: %v; removed with --force", serr)
	}
	cur, err := os.Lstat(path)
	if err != nil || !os.SameFile(cur, mustStat(f)) {
		return "", fmt.Errorf("%s was replaced while looking at it; try again", path)
	}
	if err := os.Remove(path); err != nil {
		return "", err
	}
	removeStatsNote(name, mustStat(f))
	return detail, nil
}

// removeStatsNote removes the pipeline figures a producer of the removed
// channel wrote (stat_pipeline.go), if they are the channel owner's.
func removeStatsNote(name string, channel os.FileInfo) {
	note := shmDir + "/" + statsNotePrefix + name
	st, err := os.Lstat(note)
	if err != nil || !st.Mode().IsRegular() || channel == nil {
		return
	}
	a, aok := st.Sys().(*syscall.Stat_t)
	b, bok := channel.Sys().(*syscall.Stat_t)
	if aok && bok && a.Uid == b.Uid {
		_ = os.Remove(note)
	}
}

// mustStat is f's FileInfo, or nil (which SameFile treats as different).
func mustStat(f *os.File) os.FileInfo {
	st, err := f.Stat()
	if err != nil {
		return nil
	}
	return st
}

// removeCaches removes this user's unused decoded-sample caches (rm --caches).
func removeCaches(e *env, res *rmResult, match string, quiet bool) {
	caches, err := listCaches(shmDir)
	if err != nil {
		fmt.Fprintf(e.stderr, "tsock rm: %v\n", err)
		return
	}
	for _, c := range caches {
		if c.UID != os.Geteuid() {
			continue // another user's: theirs to remove
		}
		if ok, _ := filepath.Match(match, filepath.Base(c.Path)); !ok {
			continue
		}
		if err := removeCache(c.Path); err != nil {
			res.Refused = append(res.Refused, rmRefusal{Name: c.Path, Reason: err.Error()})
			if !quiet {
				fmt.Fprintf(e.stderr, "tsock rm: %s: %v\n", c.Path, err)
			}
			continue
		}
		res.Caches = append(res.Caches, c.Path)
		if !quiet {
			fmt.Fprintf(e.stdout, "removed %s (decoded-sample cache, %s)\n", c.Path, humanBytes(c.Bytes))
		}
	}
}

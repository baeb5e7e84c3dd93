package main

import (
	"flag"
	"fmt"
	"io"
	"text/tabwriter"
	"time"
)

func init() {
	register(&command{
		name:    "ls",
		args:    "[NAME...]",
		summary: "list the channels in /dev/shm: producer, state, readers, geometry",
		help: `Lists every channel (/dev/shm/tsock.NAME), or the named ones, without
touching them: segments are mapped read-only, no lock is taken, no reader
record is claimed.

STATE is open (a live producer holds the channel), closed (the producer
closed it; readers drain what is left), dead (no live producer: it was
killed; 'tsock rm' removes it, and a new producer of the same name replaces
it), invalid (not a usable segment: foreign file, symbolic link, truncated,
other layout version) or no-access (this user may not open it).
READERS counts live readers; records left by dead readers that the
producer has not reclaimed yet are shown as "+N dead".

Leftover hidden temporary files of producers that died while creating a
channel (/dev/shm/.tsock-tmp.PID.*) are listed after the table, and then
the decoded-sample caches of tsock.Pipeline(cache_bytes=...)
(/dev/shm/tsock-cache.UID.KEY): owner, bytes, in use or not.

Exit status: 0, or 1 if a named channel does not exist.`,
		run:   runLs,
		flags: func() *flag.FlagSet { var o lsOptions; return o.flagSet(io.Discard) },
	})
}

type lsOptions struct {
	jsonOut bool
	readers bool
	match   string
}

func (o *lsOptions) flagSet(w io.Writer) *flag.FlagSet {
	fs := newFlagSet("ls", w)
	fs.BoolVar(&o.jsonOut, "json", false, "print JSON: {\"channels\": [...], \"temp_files\": [...], \"caches\": [...]}")
	fs.BoolVar(&o.readers, "readers", false, "also list each channel's reader records")
	fs.StringVar(&o.match, "match", "*", "only channels whose name matches this glob")
	return fs
}

// lsResult is the --json output of ls.
type lsResult struct {
	Channels  []channelInfo `json:"channels"`
	TempFiles []tempFile    `json:"temp_files"`
	Caches    []cacheFile   `json:"caches"`
}

func runLs(e *env, args []string) int {
	var o lsOptions
	fs := o.flagSet(e.stderr)
	names, st, ok := parseInterspersed(fs, args)
	if !ok {
		return st
	}
	status := exitOK
	if len(names) == 0 {
		all, err := listChannels(o.match)
		if err != nil {
			fmt.Fprintf(e.stderr, "tsock ls: %v\n", err)
			return exitUsage
		}
		names = all
	}
	res := lsResult{Channels: []channelInfo{}, TempFiles: []tempFile{}, Caches: []cacheFile{}}
	for _, n := range names {
		ci, err := inspectChannel(n)
		if err != nil {
			fmt.Fprintf(e.stderr, "tsock ls: %v\n", err)
			status = exitFail
			continue
		}
		if !o.readers && !o.jsonOut {
			ci.ReaderList = nil
		}
		res.Channels = append(res.Channels, ci)
	}
	if tmps, err := listTempFiles(shmDir); err == nil {
		res.TempFiles = append(res.TempFiles, tmps...)
	}
	if caches, err := listCaches(shmDir); err == nil {
		res.Caches = caches
	}
	if o.jsonOut {
		if err := writeJSON(e.stdout, res); err != nil {
			return exitFail
		}
		return status
	}
	printLs(e.stdout, res, o.readers)
	return status
}

func printLs(w io.Writer, res lsResult, withReaders bool) {
	if len(res.Channels) == 0 {
		fmt.Fprintln(w, "no tsock channels in /dev/shm")
	} else {
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		fmt.Fprintln(tw, "NAME\tPID\tSTATE\tREADERS\tSLOTS\tSLOT BYTES\tPUBLISHED\tMODE")
		for _, c := range res.Channels {
			if c.State == stateInvalid || c.State == stateNoAccess {
				fmt.Fprintf(tw, "%s\t-\t%s\t-\t-\t-\t-\t%s\t(%s)\n", c.Name, c.State, c.Mode, c.Error)
				continue
			}
			readers := fmt.Sprint(c.Readers)
			if c.DeadRecords > 0 {
				readers += fmt.Sprintf(" +%d dead", c.DeadRecords)
			}
			fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%d\t%s\t%d\t%s\n", c.Name, c.ProducerPid, c.State, readers,
				c.Slots, humanBytes(c.SlotBytes), c.Published, c.Mode)
		}
		_ = tw.Flush()
	}
	if withReaders {
		for _, c := range res.Channels {
			if len(c.ReaderList) == 0 {
				continue
			}
			fmt.Fprintf(w, "\nreaders of %s:\n", c.Name)
			tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "  RECORD\tPID\tSTATE\tPROCESS\tCURSOR\tLAG\tBATCHES\tWAITED\tPLACEMENT")
			for _, r := range c.ReaderList {
				alive := "alive"
				if !r.Alive {
					alive = "dead"
				}
				fmt.Fprintf(tw, "  %d\t%d\t%s\t%s\t%d\t%d\t%d\t%s\t%s\n", r.Index, r.Pid, r.State, alive, r.Cursor, r.Lag,
					r.Batches, time.Duration(r.WaitNs).Round(time.Millisecond), r.Placement)
			}
			_ = tw.Flush()
		}
	}
	dead := 0
	for _, t := range res.TempFiles {
		if !t.Alive {
			dead++
		}
	}
	if len(res.TempFiles) > 0 {
		fmt.Fprintf(w, "\n%d producer temporary files in /dev/shm (%d of dead producers; 'tsock rm --all-dead' removes those):\n",
			len(res.TempFiles), dead)
		for _, t := range res.TempFiles {
			st := "creator alive"
			if !t.Alive {
				st = "creator dead"
			}
			fmt.Fprintf(w, "  %s (pid %d, %s)\n", t.Path, t.Pid, st)
		}
	}
	printCaches(w, res.Caches)
}

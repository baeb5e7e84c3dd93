package main

// Inspection of the channels in /dev/shm, shared by ls, stat and rm. It
// only reads: segments are opened read-only (ring.OpenSegment), no lock is
// taken and no reader record is claimed, so inspecting a channel never
// changes what its producer and readers see.

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/tsock/tsock/ring"
)

// Channel states shown by ls and stat.
const (
	stateOpen     = "open"      // a live producer holds the producer lock
	stateClosed   = "closed"    // the producer closed it (readers drain, then see "closed")
	stateDead     = "dead"      // nobody holds the producer lock: the producer died
	stateInvalid  = "invalid"   // not a usable segment (foreign, truncated, other layout, link, ...)
	stateNoAccess = "no-access" // this user may not open it
)

// tmpPrefix is the hidden name under which producers build a segment
// before linking it to its public name: .tsock-tmp.<pid>.<random>.
const tmpPrefix = ".tsock-tmp."

// shmDir is where channels live; tests point it elsewhere only for the
// temp-file sweep, never for segments (ring.ChannelPath is fixed).
var shmDir = ring.ShmDir

// readerInfo is one reader record as ls and stat report it.
type readerInfo struct {
	Index    uint32 `json:"index"`
	Pid      int32  `json:"pid"`
	State    string `json:"state"` // active, evicted, invalid
	Alive    bool   `json:"alive"` // attached: the live producer says so, else its presence lock is held
	Cursor   uint64 `json:"cursor"`
	Acquired uint64 `json:"acquired"`
	Lag      uint64 `json:"lag"` // published - cursor: batches not yet released
	Batches  uint64 `json:"batches"`
	WaitNs   uint64 `json:"wait_ns"`
	// Where it reads batches from: host, pinned (host memory registered
	// with CUDA on GPU) or device (the producer's device pool on GPU).
	Placement string `json:"placement"`
	GPU       string `json:"gpu,omitempty"`          // UUID of the reader's device
	CUDAIndex *int32 `json:"cuda_ordinal,omitempty"` // that device in the reader's own numbering

	startTime uint64
	attachNs  uint64 // CLOCK_MONOTONIC of its admission, from the producer; 0 unknown
}

// gpuPoolInfo is a channel's device pool.
type gpuPoolInfo struct {
	GPU         string `json:"gpu"`          // UUID
	CUDAOrdinal int32  `json:"cuda_ordinal"` // in the producer's numbering
	Bytes       uint64 `json:"bytes"`
}

// channelInfo is what ls reports for one channel.
type channelInfo struct {
	Name           string       `json:"name"`
	Path           string       `json:"path"`
	State          string       `json:"state"`
	Error          string       `json:"error,omitempty"`
	ProducerPid    int32        `json:"producer_pid"`
	Readers        int          `json:"readers"`      // live readers
	DeadRecords    int          `json:"dead_records"` // records of dead readers not yet reclaimed
	ReaderCapacity uint32       `json:"reader_capacity"`
	Slots          uint32       `json:"slots"`
	SlotBytes      uint64       `json:"slot_bytes"`
	TotalBytes     uint64       `json:"total_bytes"`
	Published      uint64       `json:"published"`
	Epoch          uint64       `json:"epoch"`
	Created        string       `json:"created,omitempty"` // RFC 3339
	Mode           string       `json:"mode"`              // permission bits, octal
	Uid            uint32       `json:"uid"`
	Gid            uint32       `json:"gid"`
	GPUPool        *gpuPoolInfo `json:"gpu_pool,omitempty"`
	ReaderList     []readerInfo `json:"reader_list,omitempty"`
}

// tempFile is a leftover hidden temporary file of a producer.
type tempFile struct {
	Path  string `json:"path"`
	Pid   int    `json:"pid"`   // its creator
	Alive bool   `json:"alive"` // the creator still runs
}

// errNoChannel says that no file exists at a channel's path.
var errNoChannel = errors.New("no such channel")

// inspectChannel reads everything ls shows about channel name. A file
// that is not a usable segment is reported with state invalid or
// no-access, not as an error; errNoChannel when nothing is there.
func inspectChannel(name string) (channelInfo, error) {
	ci := channelInfo{Name: name, Path: ring.ChannelPath(name)}
	st, err := os.Lstat(ci.Path)
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return ci, fmt.Errorf("%w %q (%s)", errNoChannel, name, ci.Path)
		}
		return ci, err
	}
	ci.Mode = fmt.Sprintf("%04o", st.Mode().Perm())
	if sys, ok := st.Sys().(*syscall.Stat_t); ok {
		ci.Uid, ci.Gid = sys.Uid, sys.Gid
	}
	ci.TotalBytes = uint64(st.Size())
	switch {
	case st.Mode()&os.ModeSymlink != 0:
		ci.State, ci.Error = stateInvalid, "symbolic link (tsock never follows links in "+ring.ShmDir+")"
		return ci, nil
	case !st.Mode().IsRegular():
		ci.State, ci.Error = stateInvalid, "not a regular file ("+st.Mode().Type().String()+")"
		return ci, nil
	}
	seg, err := ring.OpenSegment(name)
	if err != nil {
		ci.State, ci.Error = stateInvalid, err.Error()
		if errors.Is(err, os.ErrPermission) {
			ci.State = stateNoAccess
		}
		return ci, nil
	}
	defer seg.Close()
	fillChannelInfo(&ci, seg)
	return ci, nil
}

// fillChannelInfo reads the header and reader table of an open segment.
func fillChannelInfo(ci *channelInfo, seg *ring.Segment) {
	info := seg.Info()
	ci.ProducerPid = info.ProducerPid
	ci.ReaderCapacity, ci.Slots, ci.SlotBytes = info.Readers, info.Slots, info.SlotPayloadBytes
	ci.TotalBytes = info.TotalBytes
	ci.Published, ci.Epoch = seg.Published(), seg.Epoch()
	if info.CreatedNs != 0 {
		ci.Created = time.Unix(0, int64(info.CreatedNs)).UTC().Format(time.RFC3339)
	}
	ci.State = channelState(seg)
	if pool, ok := seg.GPUPool(); ok {
		ci.GPUPool = &gpuPoolInfo{GPU: formatUUID(pool.UUID), CUDAOrdinal: pool.Ordinal, Bytes: pool.PoolBytes}
	}
	recs, err := seg.LiveRecords()
	if err != nil {
		ci.Error = "reading reader locks: " + err.Error()
		return
	}
	ci.ReaderList = ci.ReaderList[:0]
	// A live producer frees a reader's entry the moment its connection
	// ends: its roster is the truth. Once it is gone (or closed the
	// channel), the readers' presence locks are all there is.
	rosterTrue := ci.State == stateOpen
	for _, r := range recs {
		ri := readerFromRecord(r, ci.Published, uint64(ci.Slots), rosterTrue)
		switch {
		case ri.Alive && (r.State == ring.ReaderActive || r.State == ring.ReaderEvicted):
			ci.Readers++
		case !ri.Alive && r.State == ring.ReaderActive:
			ci.DeadRecords++
		}
		ci.ReaderList = append(ci.ReaderList, ri)
	}
}

// readerFromRecord converts a raw roster entry; lag is computed against
// published, clamped like the producer clamps (a cursor is untrusted),
// and at most the ring's slots: the roster's cursor is the producer's copy
// of up to TSOCK_MIRROR_MS ago, while published is read now, so a reader
// that kept up can look a batch or two further behind than a ring allows.
// rosterTrue: the producer lives, and its claim word says who is attached.
func readerFromRecord(r ring.RecordLive, published, slots uint64, rosterTrue bool) readerInfo {
	alive := r.Locked
	if rosterTrue {
		alive = r.State == ring.ReaderActive || r.State == ring.ReaderEvicted
	}
	ri := readerInfo{Index: r.Index, Pid: r.Pid, State: ring.StateName(r.State), Alive: alive,
		Cursor: r.Cursor, Acquired: r.Acquired, Batches: r.Batches, WaitNs: r.WaitNs, startTime: r.StartTime,
		attachNs: r.AttachNs}
	if r.Cursor < published {
		ri.Lag = min(published-r.Cursor, slots)
	}
	ri.Placement = placementName(r.Placement)
	if r.Placement == ring.PlacementPinned || r.Placement == ring.PlacementDevice {
		ri.GPU = formatUUID(r.GPUUUID)
		ordinal := r.CUDAOrdinal
		ri.CUDAIndex = &ordinal
	}
	return ri
}

// placementName names a reader-written placement; any other value is shown,
// not trusted.
func placementName(p uint32) string {
	switch p {
	case ring.PlacementHost:
		return "host"
	case ring.PlacementPinned:
		return "pinned"
	case ring.PlacementDevice:
		return "device"
	}
	return fmt.Sprintf("invalid(%d)", p)
}

// formatUUID writes a CUDA UUID as NVML does, without its GPU-/MIG- prefix
// (the 16 bytes do not say which of the two it is).
func formatUUID(u [16]byte) string {
	return fmt.Sprintf("%x-%x-%x-%x-%x", u[0:4], u[4:6], u[6:8], u[8:10], u[10:16])
}

// channelState is open, closed or dead for a segment with a valid header.
func channelState(seg *ring.Segment) string {
	if seg.State() == ring.StateClosed {
		return stateClosed
	}
	locked, err := seg.ProducerLocked()
	if err != nil || locked {
		return stateOpen // an error reading the lock: do not call a producer dead
	}
	return stateDead
}

// listChannels returns the names of the channel files in /dev/shm that
// match the glob pattern (path.Match), sorted.
func listChannels(pattern string) ([]string, error) {
	if _, err := path.Match(pattern, ""); err != nil {
		return nil, fmt.Errorf("bad --match pattern %q: %w", pattern, err)
	}
	ents, err := os.ReadDir(ring.ShmDir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, e := range ents {
		n, ok := strings.CutPrefix(e.Name(), ring.ShmPrefix)
		if !ok || n == "" {
			continue
		}
		if m, _ := path.Match(pattern, n); m {
			names = append(names, n)
		}
	}
	sort.Strings(names)
	return names, nil
}

// listTempFiles returns the producers' hidden temporary files in dir.
func listTempFiles(dir string) ([]tempFile, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []tempFile
	for _, e := range ents {
		rest, ok := strings.CutPrefix(e.Name(), tmpPrefix)
		if !ok {
			continue
		}
		pidText, _, _ := strings.Cut(rest, ".")
		pid, err := strconv.Atoi(pidText)
		tf := tempFile{Path: dir + "/" + e.Name(), Pid: pid}
		// A name we cannot parse has no known creator: treat it as alive,
		// so that nothing we do not understand is removed.
		tf.Alive = err != nil || pid <= 0 || processAlive(pid)
		out = append(out, tf)
	}
	return out, nil
}

// processAlive reports whether a process with this pid exists.
func processAlive(pid int) bool {
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// parseInterspersed parses flags that may come before, between or after
// positional arguments (tsock stat NAME --interval 1s), and returns the
// positional arguments. "--" ends flag parsing.
func parseInterspersed(fs *flag.FlagSet, args []string) (pos []string, status int, ok bool) {
	for {
		if st, ok := parseFlags(fs, args); !ok {
			return nil, st, false
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return pos, exitOK, true
		}
		if len(args) > len(rest) && args[len(args)-len(rest)-1] == "--" {
			return append(pos, rest...), exitOK, true
		}
		pos = append(pos, rest[0])
		args = rest[1:]
	}
}

// writeJSON prints v as indented JSON.
func writeJSON(w io.Writer, v any) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// humanBytes writes a byte count with a binary unit (4 KiB, 1.5 MiB).
func humanBytes(n uint64) string {
	const unit = 1024
	if n < unit {
		return fmt.Sprintf("%d B", n)
	}
	div, exp := uint64(unit), 0
	for m := n / unit; m >= unit; m /= unit {
		div *= unit
		exp++
	}
	v := float64(n) / float64(div)
	s := strconv.FormatFloat(v, 'f', 1, 64)
	s = strings.TrimSuffix(s, ".0")
	return s + " " + string("KMGTPE"[exp]) + "iB"
}

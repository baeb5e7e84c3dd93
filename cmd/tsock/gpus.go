package main

import (
	"flag"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
)

func init() {
	register(&command{
		name:    "gpus",
		summary: "show the GPUs and their MIG instances (through NVML)",
		help: `Lists the node's NVIDIA GPUs through NVML (github.com/NVIDIA/go-nvml):
index, name, UUID, PCI bus id, memory, MIG mode, and each MIG instance
(GPU and compute instance ids, UUID, memory). Readers on a MIG instance
cannot open CUDA IPC memory of another instance: they get the pinned-host
path.

Then, for every channel that has a device pool or a reader using CUDA,
what each live reader got: "device" (the producer's device pool, read
zero-copy through CUDA IPC), "pinned" (host memory registered for fast
copies to its GPU) or "host", with the GPU it uses. Channels are read
without a driver too.

libnvidia-ml.so.1 is loaded at run time; only this command uses it, so the
tsock libraries never depend on it. On a node without the NVIDIA driver it
prints "no NVIDIA driver found (libnvidia-ml.so.1 not loadable)" and exits
0 (JSON: "driver_loaded": false), so scripts can run it anywhere.

Exit status: 0, also without a driver; 1 if NVML fails otherwise.`,
		run:   runGpus,
		flags: func() *flag.FlagSet { var j bool; return gpusFlagSet(io.Discard, &j) },
	})
}

// Messages of the no-driver cases (documented in the help).
const (
	msgNoDriver        = "no NVIDIA driver found (libnvidia-ml.so.1 not loadable)"
	msgDriverNotLoaded = "NVIDIA driver not loaded (libnvidia-ml.so.1 found, but the kernel driver is not running)"
)

// gpuReport is the outcome of a query (and the --json output).
type gpuReport struct {
	DriverLoaded  bool      `json:"driver_loaded"`
	Error         string    `json:"error,omitempty"` // why there is no list
	DriverVersion string    `json:"driver_version,omitempty"`
	NVMLVersion   string    `json:"nvml_version,omitempty"`
	CUDAVersion   string    `json:"cuda_driver_version,omitempty"` // e.g. "12.4"
	GPUs          []gpuInfo `json:"gpus"`
	// Channels that use CUDA: their device pool and their readers' placement.
	Channels []gpuChannel `json:"channels"`
	failed   bool         // NVML failed for another reason than a missing driver
}

// gpuChannel is a channel as tsock gpus shows it.
type gpuChannel struct {
	Name    string       `json:"name"`
	Pool    *gpuPoolInfo `json:"gpu_pool"` // null: host memory only
	Readers []readerInfo `json:"readers"`  // live readers
}

// gpuInfo is one physical GPU.
type gpuInfo struct {
	Index       int       `json:"index"`
	Name        string    `json:"name"`
	UUID        string    `json:"uuid"`
	PCIBusID    string    `json:"pci_bus_id,omitempty"`
	MemoryBytes uint64    `json:"memory_bytes"`
	MIG         string    `json:"mig"`                   // enabled, disabled, unsupported
	MIGPending  string    `json:"mig_pending,omitempty"` // after the next reset, if it differs
	MIGDevices  []migInfo `json:"mig_devices"`
	Problem     string    `json:"problem,omitempty"` // a query that failed for this GPU
}

// migInfo is one MIG device (a compute instance in a GPU instance).
type migInfo struct {
	Index           int    `json:"index"`
	Name            string `json:"name,omitempty"`
	UUID            string `json:"uuid"`
	GPUInstance     int    `json:"gpu_instance"`
	ComputeInstance int    `json:"compute_instance"`
	MemoryBytes     uint64 `json:"memory_bytes"`
}

// gpuQuery collects the report; the NVML implementation is in
// gpus_nvml.go, tests replace it with a fake topology.
var gpuQuery = queryNVML

func gpusFlagSet(w io.Writer, jsonOut *bool) *flag.FlagSet {
	fs := newFlagSet("gpus", w)
	fs.BoolVar(jsonOut, "json", false, "print the report as JSON")
	return fs
}

func runGpus(e *env, args []string) int {
	var jsonOut bool
	fs := gpusFlagSet(e.stderr, &jsonOut)
	if st, ok := parseFlags(fs, args); !ok {
		return st
	}
	if fs.NArg() != 0 {
		fmt.Fprintf(e.stderr, "usage: tsock gpus [--json]\n")
		return exitUsage
	}
	rep := gpuQuery()
	if rep.GPUs == nil {
		rep.GPUs = []gpuInfo{}
	}
	rep.Channels = gpuChannels()
	if jsonOut {
		_ = writeJSON(e.stdout, rep)
	} else {
		printGpus(e.stdout, rep)
	}
	if rep.failed {
		if !jsonOut {
			fmt.Fprintf(e.stderr, "tsock gpus: %s\n", rep.Error)
		}
		return exitFail
	}
	return exitOK
}

// gpuChannels lists the channels that have a device pool or a live
// reader on CUDA. Unreadable channels are left out (tsock ls shows them).
func gpuChannels() []gpuChannel {
	out := []gpuChannel{}
	names, err := listChannels("*")
	if err != nil {
		return out
	}
	for _, name := range names {
		ci, err := inspectChannel(name)
		if err != nil || ci.State == stateInvalid || ci.State == stateNoAccess {
			continue
		}
		ch := gpuChannel{Name: name, Pool: ci.GPUPool, Readers: []readerInfo{}}
		usesCUDA := ci.GPUPool != nil
		for _, r := range ci.ReaderList {
			if !r.Alive || r.State == "free" {
				continue
			}
			ch.Readers = append(ch.Readers, r)
			usesCUDA = usesCUDA || r.Placement != "host"
		}
		if usesCUDA {
			out = append(out, ch)
		}
	}
	return out
}

// gpuName names a UUID after the GPU or MIG instance NVML lists with it.
func gpuName(r gpuReport, uuid string) string {
	for _, g := range r.GPUs {
		if strings.EqualFold(strings.TrimPrefix(g.UUID, "GPU-"), uuid) {
			return fmt.Sprintf("GPU %d (GPU-%s)", g.Index, uuid)
		}
		for _, m := range g.MIGDevices {
			if strings.EqualFold(strings.TrimPrefix(m.UUID, "MIG-"), uuid) {
				return fmt.Sprintf("MIG %d of GPU %d (MIG-%s)", m.Index, g.Index, uuid)
			}
		}
	}
	return uuid
}

func printGpuChannels(w io.Writer, r gpuReport) {
	for _, c := range r.Channels {
		if c.Pool != nil {
			fmt.Fprintf(w, "channel %s: device pool of %s on %s (the producer's cuda:%d)\n", c.Name,
				humanBytes(c.Pool.Bytes), gpuName(r, c.Pool.GPU), c.Pool.CUDAOrdinal)
		} else {
			fmt.Fprintf(w, "channel %s: no device pool (host memory only)\n", c.Name)
		}
		tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
		for _, rd := range c.Readers {
			where := ""
			if rd.GPU != "" {
				where = fmt.Sprintf("%s, its cuda:%d", gpuName(r, rd.GPU), *rd.CUDAIndex)
			}
			fmt.Fprintf(tw, "  reader %d\tpid %d\t%s\t%s\n", rd.Index, rd.Pid, rd.Placement, where)
		}
		_ = tw.Flush()
	}
}

func printGpus(w io.Writer, r gpuReport) {
	defer printGpuChannels(w, r)
	if !r.DriverLoaded || r.failed {
		fmt.Fprintln(w, r.Error)
		return
	}
	fmt.Fprintf(w, "NVIDIA driver %s, NVML %s, CUDA %s: %d GPUs\n", r.DriverVersion, r.NVMLVersion, r.CUDAVersion, len(r.GPUs))
	anyMIG := false
	for _, g := range r.GPUs {
		fmt.Fprintf(w, "GPU %d  %s  %s", g.Index, g.Name, g.UUID)
		if g.PCIBusID != "" {
			fmt.Fprintf(w, "  bus %s", g.PCIBusID)
		}
		fmt.Fprintf(w, "  %s  MIG %s", humanBytes(g.MemoryBytes), g.MIG)
		if g.MIGPending != "" {
			fmt.Fprintf(w, " (%s after reset)", g.MIGPending)
		}
		fmt.Fprintln(w)
		if g.Problem != "" {
			fmt.Fprintf(w, "  (%s)\n", g.Problem)
		}
		for _, m := range g.MIGDevices {
			anyMIG = true
			name := ""
			if m.Name != "" {
				name = "  " + m.Name
			}
			fmt.Fprintf(w, "  MIG %d  %s  GPU instance %d  compute instance %d  %s%s\n", m.Index, m.UUID,
				m.GPUInstance, m.ComputeInstance, humanBytes(m.MemoryBytes), name)
		}
	}
	if anyMIG {
		fmt.Fprintln(w, "note: CUDA IPC does not cross MIG instances; readers on a MIG instance use pinned host memory.")
	}
}

package main

import (
	"flag"
	"fmt"
	"io"
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
	failed        bool      // NVML failed for another reason than a missing driver
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

func printGpus(w io.Writer, r gpuReport) {
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

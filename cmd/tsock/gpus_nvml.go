package main

// The NVML side of `tsock gpus`. go-nvml opens libnvidia-ml.so.1 with
// dlopen when Init is called, so this binary builds and runs on a machine
// without the driver. Only cmd/tsock imports go-nvml: NVML stays out of
// libtsock.so (TestNVMLStaysOutOfLibraries checks it).

import (
	"fmt"
	"strings"

	"github.com/NVIDIA/go-nvml/pkg/nvml"
)

func queryNVML() (rep gpuReport) {
	switch ret := nvml.Init(); ret {
	case nvml.SUCCESS:
	case nvml.ERROR_LIBRARY_NOT_FOUND:
		rep.Error = msgNoDriver
		return rep
	case nvml.ERROR_DRIVER_NOT_LOADED:
		rep.Error = msgDriverNotLoaded
		return rep
	default:
		rep.Error, rep.failed = "NVML initialisation failed: "+nvml.ErrorString(ret), true
		return rep
	}
	defer nvml.Shutdown()
	rep.DriverLoaded = true
	rep.DriverVersion, _ = nvml.SystemGetDriverVersion()
	rep.NVMLVersion, _ = nvml.SystemGetNVMLVersion()
	if v, ret := nvml.SystemGetCudaDriverVersion(); ret == nvml.SUCCESS {
		rep.CUDAVersion = fmt.Sprintf("%d.%d", v/1000, v%1000/10)
	}
	n, ret := nvml.DeviceGetCount()
	if ret != nvml.SUCCESS {
		rep.Error, rep.failed = "NVML: counting devices: "+nvml.ErrorString(ret), true
		return rep
	}
	for i := 0; i < n; i++ {
		rep.GPUs = append(rep.GPUs, queryDevice(i))
	}
	return rep
}

func queryDevice(i int) gpuInfo {
	g := gpuInfo{Index: i, MIG: "unsupported", MIGDevices: []migInfo{}}
	dev, ret := nvml.DeviceGetHandleByIndex(i)
	if ret != nvml.SUCCESS {
		g.Problem = "handle: " + nvml.ErrorString(ret)
		return g
	}
	var problems []string
	note := func(what string, ret nvml.Return) {
		if ret != nvml.SUCCESS && ret != nvml.ERROR_NOT_SUPPORTED {
			problems = append(problems, what+": "+nvml.ErrorString(ret))
		}
	}
	g.Name, ret = dev.GetName()
	note("name", ret)
	g.UUID, ret = dev.GetUUID()
	note("uuid", ret)
	if pci, ret := dev.GetPciInfo(); ret == nvml.SUCCESS {
		g.PCIBusID = cString(pci.BusId[:])
	}
	if mem, ret := dev.GetMemoryInfo(); ret == nvml.SUCCESS {
		g.MemoryBytes = mem.Total
	} else {
		note("memory", ret)
	}
	cur, pending, ret := dev.GetMigMode()
	if ret == nvml.SUCCESS {
		g.MIG = migModeName(cur)
		if pending != cur {
			g.MIGPending = migModeName(pending)
		}
	} else {
		note("MIG mode", ret)
	}
	if ret == nvml.SUCCESS && cur == nvml.DEVICE_MIG_ENABLE {
		max, ret := dev.GetMaxMigDeviceCount()
		note("MIG device count", ret)
		for k := 0; k < max; k++ {
			mig, ret := dev.GetMigDeviceHandleByIndex(k)
			if ret == nvml.ERROR_NOT_FOUND || ret == nvml.ERROR_INVALID_ARGUMENT {
				continue // no MIG device at this index
			}
			if ret != nvml.SUCCESS {
				note(fmt.Sprintf("MIG device %d", k), ret)
				continue
			}
			m := migInfo{Index: k}
			m.UUID, _ = mig.GetUUID()
			m.Name, _ = mig.GetName()
			m.GPUInstance, _ = mig.GetGpuInstanceId()
			m.ComputeInstance, _ = mig.GetComputeInstanceId()
			if mem, ret := mig.GetMemoryInfo(); ret == nvml.SUCCESS {
				m.MemoryBytes = mem.Total
			}
			g.MIGDevices = append(g.MIGDevices, m)
		}
	}
	g.Problem = strings.Join(problems, "; ")
	return g
}

func migModeName(m int) string {
	if m == nvml.DEVICE_MIG_ENABLE {
		return "enabled"
	}
	return "disabled"
}

// cString is the text before the first NUL of a fixed-size C array.
func cString(b []uint8) string {
	n := 0
	for n < len(b) && b[n] != 0 {
		n++
	}
	return string(b[:n])
}

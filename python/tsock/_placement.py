"""Where a Consumer's batches live: host shared memory, copies on a GPU made
from pinned shared memory (_staging.py), or the producer's device pool
(_device_path.py); the GPU asked for is checked in _devices.py, and the
framework's CUDA calls are in _backends.py.

``place`` decides once, at Consumer(device=...), and returns what the
consumer needs: the output its cutter (_rebatch.py) makes leaves with, the
copy pipeline when there is one, what to undo at close, and the placement
in words. Nothing here runs per batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from . import _capi
from .errors import NoDevicePath


@dataclass
class Placement:
    """The outcome of place()."""

    #: makes every delivered leaf (view, owned, storage_dtype)
    output: object
    #: "host", "pinned" or "device" (Consumer.placement)
    where: str
    #: why the device path is not used (Consumer.placement_note)
    note: str | None = None
    #: the pinned host path's copy pipeline (_staging.Staging), or None
    staging: object = None
    #: called at close, after the reader detached
    undo: list = field(default_factory=list)


def check(device, device_path: str, output: str):
    """The device, checked before attaching: ValueError for a bad
    device_path, CUDAUnavailable when the framework sees no GPU."""
    from . import _devices

    if device_path not in _devices.DEVICE_PATHS:
        raise ValueError(f"device_path must be one of {_devices.DEVICE_PATHS}, got {device_path!r}")
    return _devices.check_device(device, output)


def place(reader, host, device, device_path: str, copy: bool, lifetime: str) -> Placement:
    """The placement of batches read by `reader` on `device`: the device path
    where it opens (unless device_path="never"), else copies from pinned
    shared memory. host is the output the consumer would use on the host."""
    from . import _backends, _device_path, _devices, _staging

    if isinstance(device, _devices.DLPackGPU):
        return _dlpack_on_device(reader, host, device, device_path, copy)
    backend = _backends.backend(device)
    note = "device_path='never'"
    if device_path != "never":
        # The default lifetime gets copies on the GPU: a zero-copy batch
        # kept in the pool would hold its slot for good.
        direct, unguard, note = _device_path.open_direct(
            reader, device, backend, host, copy or lifetime == "referenced", device_path == "require"
        )
        if direct is not None:
            return Placement(direct, "device", undo=[unguard])
    if isinstance(backend, _backends.JaxCuda):
        where = "pinned" if backend.register(reader) is None else "host"
        return Placement(_staging.JaxCopyOutput(host, backend), where, note)
    staging = _staging.Staging(backend, host)
    reader.on_release = staging.sync
    where = "pinned" if staging.register(reader) else "host"
    return Placement(staging.output, where, note, staging)


def _dlpack_on_device(reader, host, device, device_path: str, copy: bool) -> Placement:
    """output="dlpack" with a device: the device path or NoDevicePath."""
    if device_path == "never":
        raise ValueError("output='dlpack' with a device has only the device path: device_path='never' is not")
    ordinal, why = reader.open_device()
    if ordinal is None or ordinal != device.index:
        why = why or f"the producer's pool is on cuda:{ordinal} of this process, not on {device}"
        raise NoDevicePath(f"output='dlpack', device={device}: {why}", _capi.ENODEVICE)
    return Placement(type(host)(copy, cuda=ordinal), "device")

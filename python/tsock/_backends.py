"""The framework's CUDA calls behind both device placements (_device_path.py,
_staging.py): TorchCuda through torch.cuda, JaxCuda through JAX's DLPack
import. Everything CUDA a placement does goes through one of these
objects, so tests substitute a fake one to check the scheduling on
machines without a GPU."""

from __future__ import annotations

from . import _capi
from ._devices import JaxGPU
from .errors import CUDAUnavailable


class TorchCuda:
    """The CUDA side of the staging, through torch.cuda, on one device."""

    def __init__(self, device):
        import torch

        self.torch = torch
        self.device = device
        self.stream = torch.cuda.Stream(device)

    def register(self, reader) -> str | None:
        """Pins the reader's payload mapping; returns None, or why it failed."""
        torch = self.torch
        with torch.cuda.device(self.device):
            # Makes the device's (primary) context current on this thread,
            # so the registration happens there rather than on device 0.
            torch.cuda.synchronize()
            rc = reader.lib.tsock_reader_register_host(reader.handle)
        if rc == _capi.OK:
            return None
        detail = reader.lib.tsock_last_error().decode(errors="replace")
        if rc == _capi.ENOCUDA:
            raise CUDAUnavailable(f"device={str(self.device)!r}: {detail}", rc)
        return detail

    def on_stream(self):
        return self.torch.cuda.stream(self.stream)

    # ---- the device path ----

    #: capsules through tsock_batch_cuda_use on the current stream (torch
    #: takes legacy capsules; not DLPack objects, whose versioned capsules
    #: carry a read-only flag older torch refuses)
    takes_objects = False
    #: tsock_batch_cuda_use flags: order on the caller's current stream
    use_flags = 0
    #: torch 1.13 knows no kDLBool: booleans travel as uint8, viewed back
    bool_as_uint8 = True

    def current_stream(self) -> int:
        """The CUstream of the caller's current stream on the device."""
        return self.torch.cuda.current_stream(self.device).cuda_stream

    def from_capsule(self, cap):
        return self.torch.utils.dlpack.from_dlpack(cap)

    def finish(self, t, code: int, copy: bool):
        """A zero-copy device tensor as handed out: booleans viewed back
        from uint8, then a private clone (copy=True) or the read-only guard."""
        if code == _capi.DTYPE_BOOL:
            t = t.view(self.torch.bool)
        if copy:
            return t.clone()
        from . import _torch

        return t.as_subclass(_torch.ReadOnlyTensor)

    def owned(self, host_output, arr, code: int):
        """A batch assembled on the host (re-batching), moved to the device."""
        return host_output.owned_tensor(arr, code).to(self.device)

    def protect(self, base: int, length: int):
        """Guards the device pool's range against in-place writes (the same
        ReadOnlyTensor check as host batches); returns the undo."""
        from . import _torch

        _torch.add_range(base, length)
        return lambda: _torch.remove_range(base, length)

    def copy(self, host):
        return host.to(self.device, non_blocking=True)

    def record(self):
        event = self.torch.cuda.Event()
        event.record(self.stream)
        return event

    def wait(self, event) -> None:
        event.synchronize()

    def hand_out(self, event, tensors) -> None:
        stream = self.torch.cuda.current_stream(self.device)
        stream.wait_event(event)
        # The tensors were allocated on the copy stream; tell the caching
        # allocator they are used on the caller's stream too.
        for t in tensors:
            t.record_stream(stream)


class JaxCuda:
    """The device path for JAX: DLPackTensor objects to
    jax.dlpack.from_dlpack (JAX >= 0.7.2 takes no bare capsules). JAX names
    a stream in __dlpack__(stream=...), another on each call, but reads the
    array on compute streams of its own, so whatever it names, the host
    waits for the producer's copy and a release waits until the device is
    idle (TSOCK_CUDA_SYNC). JAX arrays are immutable, so no write guard is
    needed."""

    takes_objects = True

    def __init__(self, device: JaxGPU):
        import jax
        import jax.dlpack

        self.jax = jax
        self.device = device

    def from_object(self, obj):
        return self.jax.dlpack.from_dlpack(obj)

    def finish(self, t, code: int, copy: bool):
        return self.jax.numpy.array(t, copy=True) if copy else t

    def owned(self, host_output, arr, code: int):
        return self.jax.device_put(arr, self.device.jax_device)

    def protect(self, base: int, length: int):
        return lambda: None

    def register(self, reader):
        rc = reader.lib.tsock_reader_register_host(reader.handle)
        return None if rc == _capi.OK else reader.lib.tsock_last_error().decode(errors="replace")


def backend(device):
    if isinstance(device, JaxGPU):
        return JaxCuda(device)
    return TorchCuda(device)

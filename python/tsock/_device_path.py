"""The device path: the producer copies every batch once into its device
pool; a consumer on the same GPU opens the pool through CUDA IPC
(tsock_reader_open_device) and gets each tensor as a zero-copy CUDA tensor
(DLPack kDLCUDA). Its current stream is made to wait for the producer's
copy and the batch's slot is held back until the work queued on that
stream before the release has run (tsock_batch_cuda_use): nothing to
synchronise by hand."""

from __future__ import annotations

from . import _capi
from .errors import NoDevicePath, TsockError


class DirectOutput:
    """The torch or JAX output on the device path: each leaf is the batch's
    copy in the producer's device pool, zero-copy, ordered on the caller's
    current stream (torch) or waited for on the host (JAX)."""

    def __init__(self, host, backend, copy: bool, ordinal: int):
        self.name = host.name
        self._host = host
        self._backend = backend
        self.copy = copy
        self._ordinal = ordinal

    def storage_dtype(self, code: int):
        return self._host.storage_dtype(code)

    def view(self, reader, raw, i: int, start=None, stop=None):
        from ._dlpack import DLPackTensor, capsule
        from ._output import CODE

        lib = reader.lib
        backend = self._backend
        code = raw.leaves[i][CODE]
        rows = None if start is None else (start, stop)
        if backend.takes_objects:
            # The array API (JAX): its from_dlpack calls __dlpack__, and the
            # host waits for the copy whatever stream it names (see use()).
            obj = DLPackTensor(lib, raw.lease, i, rows, cuda=self._ordinal, host_wait=True)
            try:
                return backend.finish(backend.from_object(obj), code, self.copy)
            except TsockError as e:
                if e.status != _capi.EPRODUCER_GONE:
                    raise
                return self._from_host(reader, raw, i, start, stop)
        # Once per batch in effect: the same stream again is a no-op in C.
        rc = lib.cuda_use(raw.lease.batch, backend.current_stream(), backend.use_flags)
        if rc == _capi.EPRODUCER_GONE:
            # The producer died, and its device pool with it; the batches
            # it published are still in host memory: copy this one up.
            return self._from_host(reader, raw, i, start, stop)
        if rc:
            from .errors import check

            check(lib, rc, "order the batch on the current CUDA stream")
        as_uint8 = backend.bool_as_uint8 and code == _capi.DTYPE_BOOL
        cap = capsule(lib, raw.lease, i, False, as_uint8, rows, device=True)
        return backend.finish(backend.from_capsule(cap), code, self.copy)

    def owned(self, arr, code: int):
        # Batches re-cut across producer batches are assembled on the host.
        return self._backend.owned(self._host, arr, code)

    def _from_host(self, reader, raw, i: int, start, stop):
        import numpy as np

        from ._output import CODE, numpy_view

        code = raw.leaves[i][CODE]
        arr = np.array(numpy_view(raw.mem, raw.leaves[i], self._host.storage_dtype(code), start, stop))
        return self._backend.owned(self._host, arr, code)


def open_direct(reader, device, backend, host, copy: bool, required: bool):
    """The device path for `reader` if it opens on `device`: (DirectOutput,
    undo of the range guard, None), else (None, None, why not). With
    required, NoDevicePath instead of a why."""

    ordinal, why = reader.open_device()
    index = getattr(device, "index", None)
    if ordinal is not None and index is not None and ordinal != index:
        why = f"the producer's pool is on cuda:{ordinal} of this process, not on {device}"
        ordinal = None
    if ordinal is None:
        if required:
            raise NoDevicePath(f"device_path='require': {why}", _capi.ENODEVICE)
        return None, None, why
    base, length = reader.device_range()
    return DirectOutput(host, backend, copy, ordinal), backend.protect(base, length), None

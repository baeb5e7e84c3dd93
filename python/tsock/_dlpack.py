"""DLPack export of batch tensors, through tsock_batch_dlpack_export (or
tsock_batch_dlpack, its shorter case for a whole host tensor) and
PyCapsules made with ctypes (no compiled extension).

The C library alone knows the DLPack structs: it makes each descriptor as
asked (legacy or versioned, host or device, booleans as uint8, a range of
rows) in one call, and frees one no consumer took (tsock_dlpack_delete);
Python only wraps the pointer in a capsule.

A DLPackTensor is the object a framework's from_dlpack() takes: it hands out
a capsule named "dltensor_versioned" (DLPack 1.0, read-only flag set) to
consumers that ask with max_version >= (1, 0), else a legacy "dltensor".
Each descriptor is counted by the C library while it lives (the batch's
dlpack_live): with the default lifetime a batch with live descriptors is
kept, so the data stay valid as long as the tensor made from it; with
lifetime="step" they stay valid until the batch is released.
"""

from __future__ import annotations

import ctypes

from . import _capi
from .errors import check

LEGACY = b"dltensor"
VERSIONED = b"dltensor_versioned"
# DLPack's device types, as __dlpack_device__ reports them.
KDL_CPU = 1
KDL_CUDA = 2

_VERSIONED_FLAG = _capi.DLPACK_VERSIONED
_DEVICE_FLAG = _capi.DLPACK_DEVICE
_BOOL_AS_UINT8_FLAG = _capi.DLPACK_BOOL_AS_UINT8
_ROWS_FLAG = _capi.DLPACK_ROWS

_CapsuleDestructor = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

# Our own handle on the Python C API (as ctypes.pythonapi is made), so the
# prototypes declared here never clash with another library's declarations
# on the shared ctypes.pythonapi.
_api = ctypes.PyDLL(ctypes.pythonapi._name)
_api.PyCapsule_New.restype = ctypes.py_object
_api.PyCapsule_New.argtypes = [ctypes.c_void_p, ctypes.c_char_p, _CapsuleDestructor]
_api.PyCapsule_IsValid.restype = ctypes.c_int
_api.PyCapsule_IsValid.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.PyCapsule_GetPointer.restype = ctypes.c_void_p
_api.PyCapsule_GetPointer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
_api.Py_IncRef.restype = None
_api.Py_IncRef.argtypes = [ctypes.py_object]


def capsule_destructors(delete) -> tuple:
    """The capsule destructors (legacy, versioned) for the structs of the
    library whose tsock_dlpack_delete is `delete`. Keep them as long as the
    library: every capsule made with them calls them."""

    def destructor(name: bytes, versioned: int):
        # A consumer that takes the tensor renames the capsule ("used_dltensor")
        # and owns the struct from then on; only a capsule that was never
        # consumed still names our struct, which its deleter must free. What
        # destroy calls is bound here, not looked up in this module's dict,
        # which the interpreter clears at shutdown.
        is_valid, pointer = _api.PyCapsule_IsValid, _api.PyCapsule_GetPointer

        def destroy(capsule: int) -> None:
            try:
                if is_valid(capsule, name):
                    delete(pointer(capsule, name), versioned)
            except Exception:  # noqa: BLE001 - a destructor must not raise (interpreter shutdown)
                pass

        fn = _CapsuleDestructor(destroy)
        # Never freed: a capsule kept somewhere the interpreter clears late
        # at shutdown (a global of a module imported before tsock, sys) is
        # destroyed after this module and the library object are gone, and
        # a freed callback would crash the process then (review 25).
        _api.Py_IncRef(fn)
        return fn

    return destructor(LEGACY, 0), destructor(VERSIONED, 1)


_RELEASED = (
    "this tsock batch was released (the next batch was taken, and Consumer(lifetime='step') releases the one "
    "before); use copy=True, or the default lifetime, to keep batches"
)


class Lease:
    """One acquired batch of a reader. `valid` turns False when the reader
    releases it, unless it was kept first; exporters refuse to hand out a
    released batch."""

    __slots__ = ("held", "batch", "valid", "seq", "kept", "free", "__weakref__")

    def __init__(self, batch: int, seq: int):
        self.held = batch  # address of the reader's tsock_batch_t (for release)
        self.batch = batch  # the one exports read: the held batch, or the kept one
        self.seq = seq
        self.valid = True
        self.kept = False  # tsock_batch_keep: valid after its release
        self.free = None  # frees the kept batch (a weakref.finalize, called once)


def capsule(lib, lease: Lease, index: int, versioned: bool, bool_as_uint8: bool = False, rows=None, device=False):
    """A new PyCapsule holding the DLPack form of tensor `index` of a held
    batch: its host memory, or with device=True its copy in the producer's
    device pool (kDLCUDA; the reader must have opened it). bool_as_uint8
    describes a boolean tensor as uint8, for consumers that predate kDLBool
    (view the result as bool); other dtypes are unchanged. rows=(start,
    stop) narrows the tensor to those rows of its first dimension, still
    without a copy. One call to tsock_batch_dlpack_export (tsock_batch_dlpack,
    its shorter case, for a whole host tensor) makes it all."""
    if not lease.valid:
        raise BufferError(_RELEASED)
    out = ctypes.c_void_p()
    if rows is None and not (bool_as_uint8 or device):
        rc = lib.dlpack_whole(lease.batch, index, versioned, ctypes.byref(out))
    else:
        flags = _VERSIONED_FLAG if versioned else 0
        if bool_as_uint8:
            flags |= _BOOL_AS_UINT8_FLAG
        if device:
            flags |= _DEVICE_FLAG
        start = stop = 0
        if rows is not None:
            flags |= _ROWS_FLAG
            start, stop = rows
        rc = lib.dlpack(lease.batch, index, flags, start, stop, ctypes.byref(out))
    if rc == _capi.ESTATE:
        # Released meanwhile (another thread moved the consumer on): the
        # same refusal as the check above, which cannot see that race.
        raise BufferError(_RELEASED)
    if rc:
        check(lib, rc, "DLPack export")
    if versioned:
        return _api.PyCapsule_New(out.value, VERSIONED, lib.destroy_versioned)
    return _api.PyCapsule_New(out.value, LEGACY, lib.destroy_legacy)


def use(lib, lease: Lease, stream, host_wait: bool = False) -> None:
    """tsock_batch_cuda_use for a DLPack stream argument. host_wait: for a
    consumer that computes on streams other than the one it names (JAX names
    a stream for the import's readiness, then reads the array on its own
    compute streams, where an event recorded at release would not reach),
    wait for the copy on the host and fence the release with the device."""
    if not lease.valid:
        raise BufferError(_RELEASED)
    flags = 0
    if host_wait:
        stream, flags = 0, _capi.CUDA_SYNC
    elif stream is None:
        stream = 1  # the array API: None means the legacy default stream
    if stream == -1:  # the consumer orders nothing: wait on the host
        stream, flags = 0, _capi.CUDA_SYNC
    rc = lib.cuda_use(lease.batch, int(stream), flags)
    if rc:
        check(lib, rc, "order the batch on a CUDA stream")


class DLPackTensor:
    """Tensor `index` of a held batch, as a DLPack producer (the Python array
    API's __dlpack__ protocol): np.from_dlpack, torch.from_dlpack and
    jax.dlpack.from_dlpack take it without a copy. Valid while it is
    referenced (the default lifetime keeps its batch), or until the batch
    is released (lifetime="step": when the consumer takes its next batch)."""

    __slots__ = ("_lib", "_lease", "_index", "_rows", "_cuda", "_host_wait")

    def __init__(self, lib, lease: Lease, index: int, rows=None, cuda: int | None = None, host_wait=False):
        self._lib = lib
        self._lease = lease
        self._index = index
        self._rows = rows
        self._cuda = cuda  # the device ordinal when exporting the device copy
        self._host_wait = host_wait  # wait on the host whatever the stream (see use())

    def __dlpack__(self, stream=None, max_version=None, dl_device=None, copy=None):
        """A DLPack capsule: versioned (read-only flag set) when the caller
        accepts DLPack >= 1.0, else legacy. No copy is ever made: copy=True
        raises BufferError, as the protocol asks. For the device copy,
        `stream` is the consumer's CUDA stream (None or 1: the legacy
        default stream, 2: per-thread default, -1: none given, so the host
        waits): it is made to wait for the producer's copy, and the batch's
        slot is held back until the work queued on it before the release
        has run (tsock_batch_cuda_use); imported on several streams, until
        the device is idle. The consumer must read the array on the stream
        it names: JAX does not (it computes on streams of its own), so give
        JAX output="jax", which waits on the host, or keep the default
        lifetime, where the slot is held until JAX lets the array go."""
        if copy:
            raise BufferError("tsock exports shared memory without copying; copy the result instead")
        here = self.__dlpack_device__()
        if dl_device is not None and tuple(dl_device) != here:
            raise BufferError(f"this tsock tensor lives on device {here}, not {tuple(dl_device)}")
        if self._cuda is not None:
            use(self._lib, self._lease, stream, self._host_wait)
        versioned = max_version is not None and tuple(max_version) >= (1, 0)
        return capsule(self._lib, self._lease, self._index, versioned, rows=self._rows, device=self._cuda is not None)

    @property
    def leaf(self) -> int:
        """The index of the tensor in its batch."""
        return self._index

    def __dlpack_device__(self):
        """(kDLCPU, 0) for host memory, (kDLCUDA, ordinal) for the device copy."""
        return (KDL_CPU, 0) if self._cuda is None else (KDL_CUDA, self._cuda)

    def __repr__(self):
        state = "valid" if self._lease.valid else "released"
        return f"<tsock.DLPackTensor tensor {self._index} of batch {self._lease.seq}, {state}>"

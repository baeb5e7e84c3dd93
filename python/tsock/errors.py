"""tsock's exceptions.

Every exception tsock raises for a failure of the channel or of the data is a
TsockError (or a subclass) carrying `.status`, the C ABI's negative status
code (see include/tsock.h). Where a builtin exception means the same thing, the
class derives from it too, so existing handlers keep working (a BatchTooLarge
is a ValueError, an UnsupportedDtype a TypeError).
"""

from __future__ import annotations

from . import _capi


class TsockError(Exception):
    """A tsock failure. `.status` is the C status code (a negative int)."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ProducerGone(TsockError):
    """The producer process died; everything it published was delivered."""


class ChannelNotFound(TsockError):
    """No channel of that name appeared within the timeout."""


class LayoutMismatch(TsockError):
    """The channel's shared-memory layout version differs from this library's."""


class CorruptSegment(TsockError):
    """The channel's segment is truncated, foreign or inconsistent."""


class Evicted(TsockError):
    """The producer evicted this reader (it held the ring back too long)."""


class BatchTooLarge(TsockError, ValueError):
    """A batch (or its tensor count, or its structure) does not fit the channel."""


class UnsupportedDtype(TsockError, TypeError):
    """A leaf of a batch has a dtype or type tsock cannot carry or deliver."""


class ChannelClosed(TsockError):
    """The producer closed the channel and every batch was read."""


class CUDAUnavailable(TsockError, RuntimeError):
    """A CUDA device was asked for (Consumer(device="cuda:0")) where there is
    none to use: PyTorch without CUDA, no GPU visible, or no CUDA driver
    (status ENOCUDA)."""


class NoDevicePath(TsockError, RuntimeError):
    """Zero-copy device batches were required (device_path="require") but
    this consumer cannot read the producer's device pool: the producer has
    none, or its GPU is not this process's (another GPU, a MIG instance)
    (status ENODEVICE)."""


class ReadOnlyBatchError(TsockError, RuntimeError):
    """An in-place write to a batch that lives in read-only shared memory."""

    def __init__(self, message: str):
        super().__init__(message, _capi.EPERM)


class PipelineError(TsockError, RuntimeError):
    """A Pipeline could not make a batch: a stage raised (the message names
    the stage, the sample, the epoch and the batch, and carries the
    traceback from the worker), or its workers gave no batch within the
    pipeline's timeout. No C status (`.status` is None)."""


class WorkerDied(PipelineError):
    """A Pipeline's worker process died (killed, crashed, exited); the
    other workers were stopped, the next iteration starts new ones."""


class PartitionMismatch(TsockError, ValueError):
    """A Consumer's rank and world_size do not fit its channel: the channel
    is partitioned and the consumer gave no rank, or the other way round,
    or the channel is partitioned for another world size, or its producer
    makes no batch for this rank (status EINVAL)."""

    def __init__(self, message: str):
        super().__init__(message, _capi.EINVAL)


class CacheError(TsockError):
    """The decoded-sample cache cannot be used: its segment is foreign,
    truncated or of another version and in use, or the budget does not fit
    in /dev/shm. A Pipeline reports it once and computes every sample."""


_BY_STATUS = {
    _capi.EPRODUCER_GONE: ProducerGone,
    _capi.ENOENT: ChannelNotFound,
    _capi.EVERSION: LayoutMismatch,
    _capi.ECORRUPT: CorruptSegment,
    _capi.EEVICTED: Evicted,
    _capi.ETOOBIG: BatchTooLarge,
    _capi.EDTYPE: UnsupportedDtype,
    _capi.ECLOSED: ChannelClosed,
    _capi.ENOCUDA: CUDAUnavailable,
    _capi.ENODEVICE: NoDevicePath,
}


def error_for(status: int, message: str) -> TsockError:
    """The exception for a C status code, with a message."""
    return _BY_STATUS.get(status, TsockError)(message, status)


def check(lib, status: int, what: str) -> int:
    """Raises the exception for a failed C call (status < 0), with the C
    library's detailed message for this thread; returns status otherwise."""
    if status >= 0:
        return status
    detail = lib.tsock_last_error().decode(errors="replace")
    text = lib.tsock_status_str(status).decode(errors="replace")
    raise error_for(status, f"{what}: {detail or text}")

"""tsock: one producer loads and batches the data once; any number of trainer
processes on the same node read every batch zero-copy from shared memory.

    # the loader process
    with tsock.Producer(loader, name="sweep") as p:
        p.run(epochs=3)

    # each trainer process
    with tsock.Consumer("sweep", output="torch") as c:
        for epoch in range(3):
            for x, y in c:
                ...

The producer loads libtsock.so (Go runtime inside); consumers load only
libtsock_reader.so (plain C), so trainers stay fork-safe. Both are found
through TSOCK_LIBRARY_DIR, the package's _lib folder, or the repository's
build folder (see tsock._capi).
"""

from ._cache_segment import list_caches as caches
from ._cache_segment import remove_caches
from ._collate import default_collate
from ._dlpack import DLPackTensor
from ._shared import SharedLoader, SharedProducer, shared, shared_producers
from .consumer import Consumer
from .errors import (
    BatchTooLarge,
    ChannelClosed,
    ChannelNotFound,
    CorruptSegment,
    CUDAUnavailable,
    Evicted,
    LayoutMismatch,
    NoDevicePath,
    PartitionMismatch,
    PipelineError,
    ProducerGone,
    ReadOnlyBatchError,
    TsockError,
    UnsupportedDtype,
    WorkerDied,
)
from .pipeline import BatchInfo, Pipeline, Position
from .producer import Producer

__all__ = [
    "caches",
    "remove_caches",
    "Producer",
    "Consumer",
    "Pipeline",
    "shared",
    "SharedLoader",
    "shared_producers",
    "SharedProducer",
    "BatchInfo",
    "Position",
    "default_collate",
    "TsockError",
    "ProducerGone",
    "ChannelNotFound",
    "LayoutMismatch",
    "CorruptSegment",
    "Evicted",
    "BatchTooLarge",
    "UnsupportedDtype",
    "ChannelClosed",
    "ReadOnlyBatchError",
    "CUDAUnavailable",
    "NoDevicePath",
    "PartitionMismatch",
    "PipelineError",
    "WorkerDied",
    "ReadOnlyTensor",
    "DLPackTensor",
]


def __getattr__(name):
    # ReadOnlyTensor subclasses torch.Tensor: importing it imports torch, which
    # `import tsock` alone must not do.
    if name == "ReadOnlyTensor":
        from ._torch import ReadOnlyTensor

        return ReadOnlyTensor
    raise AttributeError(f"module 'tsock' has no attribute {name!r}")

"""A loader's resumable state: a position in a pipeline's known order, 48
bytes, nothing snapshotted and nothing replayed (docs/PIPELINE.md,
"Consumer side").

    magic        4   b"TSS1"
    fingerprint 16   the pipeline's (its source, stages, seed, batching);
                     zeros: no batch taken yet, resume from the beginning
    epoch        8   u64, the pipeline's epoch number of the next batch
    samples      8   u64, samples of that epoch already handed out
    batch        4   u32, the index of the next batch in that epoch
    rank         2   u16, the partition rank (0 when not partitioned)
    world_size   2   u16, the partition's world size (0: not partitioned)
    reserved     4   zero
"""

from __future__ import annotations

import struct
from typing import NamedTuple

MAGIC = b"TSS1"
_FORMAT = struct.Struct("<4s16sQQIHHI")
SIZE = _FORMAT.size  # 48
KEY = "tsock"  # the state_dict's one key
NO_FINGERPRINT = bytes(16)


class State(NamedTuple):
    fingerprint: bytes
    epoch: int
    samples: int
    batch: int
    rank: int = 0
    world_size: int = 0

    @property
    def started(self) -> bool:
        """Whether a batch was taken (a position in a known pipeline)."""
        return self.fingerprint != NO_FINGERPRINT


BEGINNING = State(NO_FINGERPRINT, 0, 0, 0)


def encode(state: State) -> dict:
    """The state_dict() of a loader at `state`."""
    return {KEY: _FORMAT.pack(MAGIC, *state, 0)}


def decode(state_dict) -> State:
    """The State of a state_dict() made by encode(); ValueError naming what
    is wrong for anything else (another loader's, truncated, corrupt)."""
    if not isinstance(state_dict, dict) or KEY not in state_dict:
        raise ValueError(f"not a tsock loader state: expected a dict with key {KEY!r}, got {_describe(state_dict)}")
    raw = state_dict[KEY]
    if isinstance(raw, (bytearray, memoryview)):
        raw = bytes(raw)
    if not isinstance(raw, bytes) or len(raw) != SIZE:
        raise ValueError(f"tsock loader state must be {SIZE} bytes, got {_describe(raw)}")
    magic, fingerprint, epoch, samples, batch, rank, world_size, reserved = _FORMAT.unpack(raw)
    if magic != MAGIC or reserved:
        raise ValueError(f"not a tsock loader state (magic {magic!r}, reserved {reserved})")
    if world_size and rank >= world_size:
        raise ValueError(f"tsock loader state is corrupt: rank {rank} of world size {world_size}")
    if fingerprint == NO_FINGERPRINT and (epoch or samples or batch):
        raise ValueError("tsock loader state is corrupt: a position without a pipeline fingerprint")
    return State(fingerprint, epoch, samples, batch, rank, world_size)


def _describe(value) -> str:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return f"{len(value)} bytes"
    return type(value).__name__

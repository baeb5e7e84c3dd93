"""A batch's structure (nested tuples, lists and dicts of tensors) and the
per-batch metadata that carries it to readers.

The metadata is at most 256 bytes (TSOCK_META_MAX), little-endian:

    4 bytes   b"TSB1"
    u64       batches per epoch (all ones: unknown)
    u64       samples per epoch (all ones: unknown)
    rest      the structure, UTF-8: "." a leaf, "(...)" a tuple, "[...]" a
              list, "{...}" a dict of key/value pairs, each key a JSON
              string. Leaves are numbered depth-first, in that order.

Example: a (images, labels) batch is "(..)", a dict {"x": ..., "y": ...} is
'{"x"."y".}'.

A batch of a tsock Pipeline carries its place in the pipeline's order
between the counts and the structure (magic b"TSB2", 52 bytes more, so its
structure has at most 184 bytes):

    16 bytes  the pipeline's fingerprint
    u64       epoch
    u64       index of the batch in the epoch's batches
    u64       position of its first sample in the epoch's order (partition
              mode: in its rank's order)
    u32       samples in the batch
    u16       rank (0 when not partitioned)
    u16       world size (0: not partitioned)
    u16       ranks whose batches the producer publishes (1 when not
              partitioned); each step of an epoch has one batch of each
    u16       reserved, 0

Readers take the structure from both; the tag is what a consumer needs to
check and resume its position (decode_tag), and what a successor producer
reads back from the newest batches of a dead producer's channel.
"""

from __future__ import annotations

import json
import struct
from typing import NamedTuple

from . import _capi
from .errors import BatchTooLarge, CorruptSegment

MAGIC = b"TSB1"
MAGIC_TAGGED = b"TSB2"
_HEAD = struct.Struct("<4sQQ")
_TAG = struct.Struct("<16sQQQIHHHH")
UNKNOWN = (1 << 64) - 1
SPEC_MAX = _capi.META_MAX - _HEAD.size
TAGGED_SPEC_MAX = SPEC_MAX - _TAG.size


class Tag(NamedTuple):
    """A pipeline batch's place: see the module's docstring."""

    fingerprint: bytes
    epoch: int
    index: int
    start: int
    samples: int
    rank: int
    world_size: int
    ranks: int


def flatten(batch) -> tuple[str, list]:
    """Splits a batch into its structure string and its leaves, depth-first."""
    leaves: list = []
    parts: list[str] = []
    _flatten(batch, leaves, parts)
    return "".join(parts), leaves


def _flatten(obj, leaves: list, parts: list) -> None:
    # tuple subclasses (namedtuples) travel as plain tuples.
    if isinstance(obj, tuple):
        parts.append("(")
        for x in obj:
            _flatten(x, leaves, parts)
        parts.append(")")
    elif isinstance(obj, list):
        parts.append("[")
        for x in obj:
            _flatten(x, leaves, parts)
        parts.append("]")
    elif isinstance(obj, dict):
        parts.append("{")
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"batch dict keys must be str, got {type(k).__name__} key {k!r}")
            parts.append(json.dumps(k, ensure_ascii=False))
            _flatten(v, leaves, parts)
        parts.append("}")
    else:
        parts.append(".")
        leaves.append(obj)


def leaf_path(batch, index: int) -> str:
    """Where leaf `index` sits in a batch, as Python indexing ("batch[1]['x']"),
    for error messages."""
    found = _leaf_path(batch, index, "batch", [0])
    return found or f"leaf {index}"


def _leaf_path(obj, index: int, path: str, counter: list) -> str | None:
    if isinstance(obj, (tuple, list)):
        items = enumerate(obj)
    elif isinstance(obj, dict):
        items = obj.items()
    else:
        counter[0] += 1
        return path if counter[0] - 1 == index else None
    for k, v in items:
        found = _leaf_path(v, index, f"{path}[{k!r}]", counter)
        if found:
            return found
    return None


def encode(spec: str, batches: int | None, samples: int | None) -> bytes:
    """The metadata of a batch; BatchTooLarge if the structure does not fit."""
    raw = _spec_bytes(spec, SPEC_MAX)
    return _HEAD.pack(MAGIC, UNKNOWN if batches is None else batches, UNKNOWN if samples is None else samples) + raw


def encode_tagged(spec: str, batches: int, samples: int, tag: Tag) -> bytes:
    """The metadata of a pipeline's batch: its counts, its tag, its structure."""
    raw = _spec_bytes(spec, TAGGED_SPEC_MAX)
    return _HEAD.pack(MAGIC_TAGGED, batches, samples) + _TAG.pack(*tag, 0) + raw


def _spec_bytes(spec: str, limit: int) -> bytes:
    raw = spec.encode()
    if len(raw) > limit:
        raise BatchTooLarge(
            f"the batch's structure needs {len(raw)} bytes of per-batch metadata, at most {limit} fit: "
            f"use fewer or shorter dict keys, or flatter nesting (structure: {spec[:80]}...)",
            _capi.ETOOBIG,
        )
    return raw


def decode_tag(meta: bytes) -> Tag | None:
    """The pipeline tag of a batch's metadata; None for a batch not from a
    Pipeline. CorruptSegment for a tag that cannot be one (written by a
    broken or foreign producer)."""
    if meta[:4] != MAGIC_TAGGED:
        return None
    if len(meta) < _HEAD.size + _TAG.size:
        raise CorruptSegment(f"pipeline batch metadata of {len(meta)} bytes, its tag needs more", _capi.ECORRUPT)
    *fields, reserved = _TAG.unpack_from(meta, _HEAD.size)
    tag = Tag(*fields)
    if tag.world_size:
        consistent = tag.rank < tag.world_size and 1 <= tag.ranks <= tag.world_size
    else:
        consistent = tag.rank == 0 and tag.ranks == 1
    if reserved or not consistent:
        raise CorruptSegment(f"pipeline batch tag is inconsistent: {tag}", _capi.ECORRUPT)
    return tag


_PARTITION = struct.Struct("<HHH")  # rank, world size, ranks: the tag's fields after samples
_PARTITION_AT = _HEAD.size + struct.calcsize("<16sQQQI")


def partition(meta: bytes) -> tuple[int, int, int] | None:
    """(rank, world size, ranks) of a Pipeline batch's tag, read at their
    place without decoding the rest (a consumer filters every batch by
    them); None for a batch not from a Pipeline. CorruptSegment when they
    cannot be a partition's."""
    if meta[:4] != MAGIC_TAGGED:
        return None
    if len(meta) < _HEAD.size + _TAG.size:
        raise CorruptSegment(f"pipeline batch metadata of {len(meta)} bytes, its tag needs more", _capi.ECORRUPT)
    rank, world, ranks = fields = _PARTITION.unpack_from(meta, _PARTITION_AT)
    consistent = rank < world and 1 <= ranks <= world if world else rank == 0 and ranks == 1
    if not consistent:
        raise CorruptSegment(
            f"pipeline batch tag is inconsistent: rank {rank}, world size {world}, ranks {ranks}", _capi.ECORRUPT
        )
    return fields


class Layout:
    """A decoded metadata blob: how to rebuild a batch from its leaves."""

    __slots__ = ("template", "n_leaves", "batches", "samples", "spec", "build")

    def __init__(self, template, n_leaves: int, batches: int | None, samples: int | None, spec: str):
        self.template = template
        self.n_leaves = n_leaves
        self.batches = batches
        self.samples = samples
        self.spec = spec
        #: build(leaves) -> the batch, in the producer's structure, around leaves
        if spec == "(" + "." * n_leaves + ")":
            self.build = tuple  # the common (x, y) batch, without a walk
        elif spec == ".":
            self.build = _first
        else:
            self.build = lambda leaves: _build(template, leaves)


def _first(leaves: list):
    return leaves[0]


_cache: dict[bytes, Layout] = {}


def flat(n_leaves: int) -> Layout:
    """The layout of a batch published without tsock Python metadata (through
    the C ABI directly): one tensor as itself, several as a tuple."""
    template = 0 if n_leaves == 1 else ("(", list(range(n_leaves)))
    return Layout(template, n_leaves, None, None, "." if n_leaves == 1 else "(" + "." * n_leaves + ")")


def decode(meta: bytes, n_tensors: int) -> Layout:
    """Parses metadata written by encode(); cached, as it rarely changes.
    Metadata from another writer gives the flat layout of n_tensors leaves."""
    spec_at = _HEAD.size
    key = meta
    if meta[:4] == MAGIC_TAGGED:
        # The tag differs in every batch: cache on the rest.
        spec_at += _TAG.size
        key = meta[: _HEAD.size] + meta[spec_at:]
    layout = _cache.get(key)
    if layout is not None and layout.n_leaves == n_tensors:
        return layout
    if len(meta) < spec_at or meta[:4] not in (MAGIC, MAGIC_TAGGED):
        return flat(n_tensors)
    _, batches, samples = _HEAD.unpack_from(meta)
    try:
        spec = meta[spec_at:].decode()
        counter = [0]
        template, end = _parse(spec, 0, counter)
        if end != len(spec) or counter[0] != n_tensors:
            raise ValueError(f"batch structure {spec!r} does not describe {n_tensors} tensors")
    except (ValueError, IndexError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise CorruptSegment(f"unreadable batch metadata {meta!r}: {e}", _capi.ECORRUPT) from None
    layout = Layout(
        template, counter[0], None if batches == UNKNOWN else batches, None if samples == UNKNOWN else samples, spec
    )
    if len(_cache) < 1024:
        _cache[key] = layout
    return layout


# Templates: an int is a leaf index; ("(", [children]), ("[", [children]),
# ("{", [(key, child), ...]).
_DECODER = json.JSONDecoder()


def _parse(spec: str, i: int, counter: list):
    if i >= len(spec):
        raise ValueError(f"truncated batch structure {spec!r}")
    c = spec[i]
    if c == ".":
        counter[0] += 1
        return counter[0] - 1, i + 1
    if c in "([":
        close = ")" if c == "(" else "]"
        children = []
        i += 1
        while spec[i] != close:
            child, i = _parse(spec, i, counter)
            children.append(child)
        return (c, children), i + 1
    if c == "{":
        entries = []
        i += 1
        while spec[i] != "}":
            key, i = _DECODER.raw_decode(spec, i)
            child, i = _parse(spec, i, counter)
            entries.append((key, child))
        return ("{", entries), i + 1
    raise ValueError(f"bad batch structure {spec!r} at {i}")


def _build(t, leaves: list):
    if type(t) is int:
        return leaves[t]
    kind, children = t
    if kind == "(":
        return tuple([_build(c, leaves) for c in children])
    if kind == "[":
        return [_build(c, leaves) for c in children]
    return {k: _build(c, leaves) for k, c in children}

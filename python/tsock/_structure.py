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
"""

from __future__ import annotations

import json
import struct

from . import _capi
from .errors import BatchTooLarge, CorruptSegment

MAGIC = b"TSB1"
_HEAD = struct.Struct("<4sQQ")
UNKNOWN = (1 << 64) - 1
SPEC_MAX = _capi.META_MAX - _HEAD.size


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
    raw = spec.encode()
    if len(raw) > SPEC_MAX:
        raise BatchTooLarge(
            f"the batch's structure needs {len(raw)} bytes of per-batch metadata, at most {SPEC_MAX} fit: "
            f"use fewer or shorter dict keys, or flatter nesting (structure: {spec[:80]}...)",
            _capi.ETOOBIG,
        )
    return _HEAD.pack(MAGIC, UNKNOWN if batches is None else batches, UNKNOWN if samples is None else samples) + raw


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
    layout = _cache.get(meta)
    if layout is not None and layout.n_leaves == n_tensors:
        return layout
    if len(meta) < _HEAD.size or meta[:4] != MAGIC:
        return flat(n_tensors)
    _, batches, samples = _HEAD.unpack_from(meta)
    try:
        spec = meta[_HEAD.size :].decode()
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
        _cache[meta] = layout
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

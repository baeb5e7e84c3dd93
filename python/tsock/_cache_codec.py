"""The bytes of a cached sample (docs/CACHE.md, "The segment").

encode(sample) -> bytearray, decode(buffer) -> sample. A sample is a nest
of tuples, lists and dicts over None, bool, int (64-bit), float, str,
bytes, numpy scalars, numpy arrays and torch tensors; anything else raises
Uncacheable (the sample is then computed every time). Nothing is pickled:
the bytes come from shared memory that other processes write, and decoding
them must not run code. decode() checks every tag, count, length, dtype,
shape and offset against the buffer and raises CorruptSample on any
mismatch, never reads outside the buffer.

Layout: b"TSC1", u32 skeleton length, the skeleton (tags, below), then the
arrays' bytes, each at a 64-byte aligned offset that its tag records.
"""

from __future__ import annotations

import struct
import sys

import numpy as np

MAGIC = b"TSC1"
VERSION = 1  # part of the cache key: a change of this format is another cache
ALIGN = 64
MAX_DEPTH = 32
_HEAD = struct.Struct("<4sI")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_ARRAY = struct.Struct("<BBBQ")  # dtype code, order (0 C, 1 F), ndim, offset
_DIM = struct.Struct("<Q")

#: numpy dtypes a cached array or scalar may have (native or no byte order).
NUMPY_DTYPES = tuple(
    np.dtype(n)
    for n in (
        "bool",
        "int8",
        "uint8",
        "int16",
        "uint16",
        "int32",
        "uint32",
        "int64",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    )
)
_NUMPY_CODE = {dt: i for i, dt in enumerate(NUMPY_DTYPES)}
#: torch dtypes by name, with the numpy dtype their bytes are moved as.
TORCH_DTYPES = (
    ("bool", "bool"),
    ("int8", "int8"),
    ("uint8", "uint8"),
    ("int16", "int16"),
    ("int32", "int32"),
    ("int64", "int64"),
    ("float16", "float16"),
    ("bfloat16", "int16"),
    ("float32", "float32"),
    ("float64", "float64"),
    ("complex64", "complex64"),
    ("complex128", "complex128"),
)
_TORCH_CODE = {name: i for i, (name, _) in enumerate(TORCH_DTYPES)}


class Uncacheable(TypeError):
    """The sample holds something the cache does not store."""


class CorruptSample(ValueError):
    """The bytes are not a sample's encoding."""


# ---- encode ----


class _Encoder:
    def __init__(self):
        self.skel = bytearray()
        self.arrays: list = []  # (array, offset in the data area)
        self.data_bytes = 0

    def add_array(self, a: np.ndarray) -> int:
        offset = -(-self.data_bytes // ALIGN) * ALIGN
        self.arrays.append((a, offset))
        self.data_bytes = offset + a.nbytes
        return offset

    def array_tag(self, tag: bytes, code: int, a: np.ndarray) -> None:
        fortran = a.ndim > 1 and a.flags.f_contiguous and not a.flags.c_contiguous
        if not (fortran or a.flags.c_contiguous):
            a = a.copy(order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
        offset = self.add_array(a)
        self.skel += tag + _ARRAY.pack(code, int(fortran), a.ndim, offset)
        for n in a.shape:
            self.skel += _DIM.pack(n)

    def walk(self, x, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise Uncacheable(f"a sample nested deeper than {MAX_DEPTH}")
        t = type(x)
        if x is None or x is True or x is False:
            self.skel += {None: b"N", True: b"T", False: b"F"}[x]
        elif t is int:
            if not -(1 << 63) <= x < 1 << 63:
                raise Uncacheable(f"an int outside 64 bits: {x}")
            self.skel += b"i" + _I64.pack(x)
        elif t is float:
            self.skel += b"f" + _F64.pack(x)
        elif t is str or t is bytes:
            raw = x.encode("utf-8", "surrogatepass") if t is str else x
            self.skel += (b"s" if t is str else b"b") + _U32.pack(len(raw)) + raw
        elif t is tuple or t is list:
            self.skel += (b"t" if t is tuple else b"l") + _U32.pack(len(x))
            for v in x:
                self.walk(v, depth + 1)
        elif t is dict:
            self.skel += b"d" + _U32.pack(len(x))
            for k, v in x.items():
                self.walk(k, depth + 1)
                self.walk(v, depth + 1)
        else:
            self.leaf(x)

    def leaf(self, x) -> None:
        if isinstance(x, np.ndarray) and type(x) is np.ndarray:
            self.array_tag(b"a", _numpy_code(x.dtype), x)
        elif isinstance(x, np.generic):
            self.skel += b"n" + bytes([_numpy_code(x.dtype)]) + np.asarray(x).tobytes()
        elif _is_torch_tensor(x):
            self.torch_tag(x)
        else:
            raise Uncacheable(f"a {type(x).__module__}.{type(x).__qualname__} (not stored by the cache)")

    def torch_tag(self, x) -> None:
        torch = sys.modules["torch"]
        if type(x) is not torch.Tensor or x.device.type != "cpu" or x.requires_grad or x.is_sparse:
            raise Uncacheable("only plain CPU torch tensors without grad are stored")
        name = str(x.dtype).rpartition(".")[2]
        code = _TORCH_CODE.get(name)
        if code is None:
            raise Uncacheable(f"torch dtype {x.dtype}")
        t = x.contiguous().resolve_conj().resolve_neg()
        arr = (t.view(torch.int16) if name == "bfloat16" else t).numpy()
        self.array_tag(b"p", code, arr)


def _numpy_code(dtype: np.dtype) -> int:
    code = _NUMPY_CODE.get(dtype)
    if code is None or dtype.byteorder not in "=|":
        raise Uncacheable(f"numpy dtype {dtype.str}")
    return code


def _is_torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def encode(sample) -> bytearray:
    """The sample's bytes (raises Uncacheable)."""
    enc = _Encoder()
    enc.walk(sample, 0)
    start = -(-(_HEAD.size + len(enc.skel)) // ALIGN) * ALIGN
    out = bytearray(start + enc.data_bytes)
    _HEAD.pack_into(out, 0, MAGIC, len(enc.skel))
    out[_HEAD.size : _HEAD.size + len(enc.skel)] = enc.skel
    view = np.frombuffer(out, dtype=np.uint8)
    for a, offset in enc.arrays:
        if a.nbytes:
            flat = a.reshape(-1, order="F" if not a.flags.c_contiguous else "C").view(np.uint8)
            view[start + offset : start + offset + a.nbytes] = flat
    return out


# ---- decode ----


class _Decoder:
    def __init__(self, buf):
        self.buf = memoryview(buf).cast("B")
        if len(self.buf) < _HEAD.size:
            raise CorruptSample(f"{len(self.buf)} bytes, shorter than a header")
        magic, skel_len = _HEAD.unpack_from(self.buf, 0)
        if magic != MAGIC:
            raise CorruptSample(f"magic {bytes(magic)!r}, not {MAGIC!r}")
        self.pos = _HEAD.size
        self.end = _HEAD.size + skel_len
        if self.end > len(self.buf):
            raise CorruptSample(f"a skeleton of {skel_len} bytes in a sample of {len(self.buf)}")
        self.data = -(-self.end // ALIGN) * ALIGN

    def take(self, n: int) -> memoryview:
        if n < 0 or self.pos + n > self.end:
            raise CorruptSample(f"a field of {n} bytes at {self.pos} runs past the skeleton's end {self.end}")
        out = self.buf[self.pos : self.pos + n]
        self.pos += n
        return out

    def unpack(self, s: struct.Struct) -> tuple:
        return s.unpack(self.take(s.size))

    def count(self) -> int:
        (n,) = self.unpack(_U32)
        if n > self.end - self.pos:  # every item takes at least one byte
            raise CorruptSample(f"a count of {n} with {self.end - self.pos} bytes left")
        return n

    def item(self, depth: int):
        if depth > MAX_DEPTH:
            raise CorruptSample(f"nested deeper than {MAX_DEPTH}")
        tag = bytes(self.take(1))
        simple = {b"N": None, b"T": True, b"F": False}
        if tag in simple:
            return simple[tag]
        if tag == b"i":
            return self.unpack(_I64)[0]
        if tag == b"f":
            return self.unpack(_F64)[0]
        if tag in (b"s", b"b"):
            raw = bytes(self.take(self.count()))
            return raw if tag == b"b" else _utf8(raw)
        if tag in (b"t", b"l"):
            items = [self.item(depth + 1) for _ in range(self.count())]
            return tuple(items) if tag == b"t" else items
        if tag == b"d":
            n = self.count()
            return {_hashable(self.item(depth + 1)): self.item(depth + 1) for _ in range(n)}
        return self.leaf(tag)

    def leaf(self, tag: bytes):
        if tag == b"n":
            dtype = _dtype(NUMPY_DTYPES, self.take(1)[0])
            return np.frombuffer(bytes(self.take(dtype.itemsize)), dtype=dtype)[0]
        if tag == b"a":
            code, order, ndim, offset = self.unpack(_ARRAY)
            return self.array(_dtype(NUMPY_DTYPES, code), order, ndim, offset)
        if tag == b"p":
            return self.tensor()
        raise CorruptSample(f"unknown tag {tag!r} at {self.pos - 1}")

    def array(self, dtype: np.dtype, order: int, ndim: int, offset: int) -> np.ndarray:
        if order > 1 or ndim > 32:
            raise CorruptSample(f"array order {order}, ndim {ndim}")
        shape = tuple(self.unpack(_DIM)[0] for _ in range(ndim))
        nbytes, extent = dtype.itemsize, 1
        for n in shape:
            nbytes *= n  # Python ints: no overflow
            extent *= max(n, 1)
        if extent >= 1 << 62:  # numpy refuses such a shape, even of 0 bytes
            raise CorruptSample(f"an array of shape {shape}")
        start = self.data + offset
        if offset % ALIGN or start + nbytes > len(self.buf):
            raise CorruptSample(f"an array of {nbytes} bytes at {offset} in a sample of {len(self.buf)}")
        flat = np.frombuffer(self.buf, dtype=np.uint8, count=nbytes, offset=start)
        return flat.view(dtype).reshape(shape, order="F" if order else "C")

    def tensor(self):
        code, order, ndim, offset = self.unpack(_ARRAY)
        name, moved = TORCH_DTYPES[_index(TORCH_DTYPES, code)]
        arr = self.array(np.dtype(moved), order, ndim, offset)
        try:
            import torch
        except ImportError:
            raise CorruptSample("a torch tensor, and torch is not installed here") from None
        t = torch.from_numpy(np.ascontiguousarray(arr))
        return t.view(torch.bfloat16) if name == "bfloat16" else t


def _index(table, code: int) -> int:
    if code >= len(table):
        raise CorruptSample(f"dtype code {code} of {len(table)}")
    return code


def _dtype(table, code: int) -> np.dtype:
    return table[_index(table, code)]


def _utf8(raw: bytes) -> str:
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError as e:
        raise CorruptSample(f"a string that is not UTF-8: {e}") from None


def _hashable(k):
    try:
        hash(k)
    except TypeError:
        raise CorruptSample(f"a dict key of type {type(k).__name__}") from None
    return k


def decode(buf):
    """The sample encoded in `buf` (a private, writable buffer: its arrays
    are views of it). Raises CorruptSample."""
    dec = _Decoder(buf)
    sample = dec.item(0)
    if dec.pos != dec.end:
        raise CorruptSample(f"{dec.end - dec.pos} bytes after the sample's skeleton")
    return sample

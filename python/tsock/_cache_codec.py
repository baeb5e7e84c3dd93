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
VERSION = 2  # part of the cache key: a change of this format is another cache
ALIGN = 64
MAX_DEPTH = 32
_HEAD = struct.Struct("<4sI")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")
_F64 = struct.Struct("<d")
_ARRAY = struct.Struct("<BBBQ")  # dtype code, layout (below), ndim, offset
# Layout byte: the low bits say how the stored (C-ordered) bytes map back
# to the array, bit 7 that the array was read-only.
C_ORDER, PERMUTED, READ_ONLY = 0, 2, 0x80
FLIPPED = 0x80  # in a PERMUTED array's axis byte: that axis runs backwards
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

    def array_tag(self, tag: bytes, code: int, a: np.ndarray, perm=None, flips=(), read_only=False) -> None:
        """An array whose memory order is kept (review 31, F3: a reduction
        in augment follows it, so another layout gives other bits): a
        C-contiguous one as it is; one whose axes, some maybe reversed,
        are a permutation of a C-contiguous array's (a transposed HWC
        image, a flip) as that array and the permutation, decoded to the
        same strides; any other layout (a step slice, a broadcast) is
        Uncacheable. `perm`/`flips`: the caller found them (torch)."""
        if perm is None and not a.flags.c_contiguous:
            perm, flips, a = _permutation(a)
        layout = C_ORDER if perm is None else PERMUTED
        offset = self.add_array(a)
        self.skel += tag + _ARRAY.pack(code, layout | (READ_ONLY if read_only else 0), len(a.shape), offset)
        shape = a.shape if perm is None else tuple(a.shape[perm.index(ax)] for ax in range(a.ndim))
        for n in shape:
            self.skel += _DIM.pack(n)
        if perm is not None:
            self.skel += bytes(ax | (FLIPPED if ax in flips else 0) for ax in perm)

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
            self.array_tag(b"a", _numpy_code(x.dtype), x, read_only=not x.flags.writeable)
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
        t = x.resolve_conj().resolve_neg()
        perm = None
        if not t.is_contiguous():
            perm = sorted(range(t.dim()), key=lambda ax: -t.stride(ax))
            t = t.permute(perm)
            if not t.is_contiguous():
                raise Uncacheable(f"a torch tensor of strides {x.stride()} (not a permutation of a contiguous one)")
        arr = (t.view(torch.int16) if name == "bfloat16" else t).numpy()
        self.array_tag(b"p", code, arr, perm=perm)


def _permutation(a: np.ndarray):
    """(perm, flipped axes, c): c is a C-contiguous view of a's memory
    with a == c.transpose(argsort(perm)) flipped along the flipped axes;
    Uncacheable if there is none."""
    flips = tuple(ax for ax in range(a.ndim) if a.strides[ax] < 0 and a.shape[ax] > 1)
    b = a[tuple(slice(None, None, -1) if ax in flips else slice(None) for ax in range(a.ndim))] if flips else a
    perm = sorted(range(b.ndim), key=lambda ax: -abs(b.strides[ax]))
    c = b.transpose(perm)
    if not c.flags.c_contiguous:
        raise Uncacheable(
            f"an array of shape {a.shape} and strides {a.strides} (a step slice or a broadcast: only arrays whose "
            "memory is contiguous, in any axis order, keep their layout; return np.ascontiguousarray(x))"
        )
    return perm, flips, c


def _numpy_code(dtype: np.dtype) -> int:
    code = _NUMPY_CODE.get(dtype)
    if code is None or dtype.byteorder not in "=|":
        raise Uncacheable(f"numpy dtype {dtype.str}")
    return code


def _is_torch_tensor(x) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


class Encoded:
    """A sample's encoding, sized but not yet copied: the store decides
    whether to keep it (a bypass costs no copy) and writes it straight
    into its blocks."""

    __slots__ = ("_enc", "_start", "nbytes")

    def __init__(self, enc: _Encoder):
        self._enc = enc
        self._start = -(-(_HEAD.size + len(enc.skel)) // ALIGN) * ALIGN
        self.nbytes = self._start + enc.data_bytes

    def __len__(self) -> int:
        return self.nbytes

    @property
    def pieces(self) -> int:
        """How many arrays into() copies one by one."""
        return len(self._enc.arrays)

    def into(self, out) -> None:
        """Writes the nbytes of the encoding into `out` (a writable buffer of
        nbytes, maybe not zeroed: every byte is written, padding included)."""
        view = np.frombuffer(out, dtype=np.uint8)
        if len(view) != self.nbytes:
            raise ValueError(f"{len(view)} bytes for an encoding of {self.nbytes}")
        skel, start = self._enc.skel, self._start
        _HEAD.pack_into(view, 0, MAGIC, len(skel))
        view[_HEAD.size : _HEAD.size + len(skel)] = np.frombuffer(skel, dtype=np.uint8)
        at = _HEAD.size + len(skel)
        for a, offset in self._enc.arrays:
            view[at : start + offset] = 0  # alignment padding
            if a.nbytes:
                view[start + offset : start + offset + a.nbytes] = a.reshape(-1).view(np.uint8)  # C-contiguous: a view
            at = start + offset + a.nbytes
        view[at:] = 0

    def tobytes(self) -> bytearray:
        out = bytearray(self.nbytes)
        self.into(out)
        return out


def prepare(sample) -> Encoded:
    """The sample's encoding, not yet copied (raises Uncacheable). It
    holds references to the sample's arrays: write it out before they
    change (before augment runs)."""
    enc = _Encoder()
    enc.walk(sample, 0)
    return Encoded(enc)


def encode(sample) -> bytearray:
    """The sample's bytes (raises Uncacheable)."""
    return prepare(sample).tobytes()


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
            raw = bytes(self.take(dtype.itemsize))
            if dtype == np.bool_:
                return np.bool_(raw[0] != 0)  # forged bytes: 0/1 only (review 31, F8)
            return np.frombuffer(raw, dtype=dtype)[0]
        if tag == b"a":
            code, layout, ndim, offset = self.unpack(_ARRAY)
            c, back, flips = self.array(_dtype(NUMPY_DTYPES, code), layout, ndim, offset)
            a = _restore(c, back, flips)
            if layout & READ_ONLY:
                a.flags.writeable = False
            return a
        if tag == b"p":
            return self.tensor()
        raise CorruptSample(f"unknown tag {tag!r} at {self.pos - 1}")

    def array(self, dtype: np.dtype, layout: int, ndim: int, offset: int):
        """(c, back, flips): the stored array c (C-ordered, a view of the
        buffer), the transpose that gives the array back (None: c is it)
        and the axes to reverse after it."""
        order = layout & ~READ_ONLY
        if order not in (C_ORDER, PERMUTED) or ndim > 32:
            raise CorruptSample(f"array layout {layout}, ndim {ndim}")
        shape = tuple(self.unpack(_DIM)[0] for _ in range(ndim))
        back, flips = None, ()
        if order == PERMUTED:
            axes = bytes(self.take(ndim))
            perm = [ax & ~FLIPPED for ax in axes]
            if sorted(perm) != list(range(ndim)):
                raise CorruptSample(f"axes {list(axes)} are not a permutation of {ndim}")
            flips = tuple(ax & ~FLIPPED for ax in axes if ax & FLIPPED)
            back = tuple(int(i) for i in np.argsort(perm))
            shape = tuple(shape[ax] for ax in perm)
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
        if dtype == np.bool_:  # forged bytes: 0/1 only, as numpy and torch assume (review 31, F8)
            if not flat.flags.writeable:
                flat = flat.copy()
            np.minimum(flat, 1, out=flat)
        return flat.view(dtype).reshape(shape), back, flips

    def tensor(self):
        code, layout, ndim, offset = self.unpack(_ARRAY)
        name, moved = TORCH_DTYPES[_index(TORCH_DTYPES, code)]
        c, back, flips = self.array(np.dtype(moved), layout, ndim, offset)
        if flips:
            raise CorruptSample("a torch tensor with reversed axes")
        try:
            import torch
        except ImportError:
            raise CorruptSample("a torch tensor, and torch is not installed here") from None
        if not c.flags.writeable:  # torch wants a writable array
            c = c.copy()
        t = torch.from_numpy(c)
        t = t.view(torch.bfloat16) if name == "bfloat16" else t
        return t if back is None else t.permute(back)


def _restore(c: np.ndarray, back, flips) -> np.ndarray:
    if back is None:
        return c
    a = c.transpose(back)
    if flips:
        a = a[tuple(slice(None, None, -1) if ax in flips else slice(None) for ax in range(a.ndim))]
    return a


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

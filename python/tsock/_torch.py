"""PyTorch support: dtype tables and ReadOnlyTensor, the guard that turns an
in-place write to a batch into an exception instead of a crash.

Batches live in shared memory that readers map read-only. numpy has a
writeable flag for that; torch tensors do not, and a write would SIGSEGV the
trainer. ReadOnlyTensor intercepts every torch operation through
__torch_function__, raises ReadOnlyBatchError for the ones that would write
into a protected tensor, and returns plain tensors from the others unless
they share the protected memory (views stay protected).

Imported only when torch is used.
"""

from __future__ import annotations

import bisect

import torch

from . import _capi
from .errors import ReadOnlyBatchError, UnsupportedDtype

FROM_TORCH = {
    torch.bool: _capi.DTYPE_BOOL,
    torch.int8: _capi.DTYPE_INT8,
    torch.int16: _capi.DTYPE_INT16,
    torch.int32: _capi.DTYPE_INT32,
    torch.int64: _capi.DTYPE_INT64,
    torch.uint8: _capi.DTYPE_UINT8,
    torch.float16: _capi.DTYPE_FLOAT16,
    torch.bfloat16: _capi.DTYPE_BFLOAT16,
    torch.float32: _capi.DTYPE_FLOAT32,
    torch.float64: _capi.DTYPE_FLOAT64,
}
# Unsigned types wider than 8 bits exist only in newer torch releases.
for _name, _code in (("uint16", _capi.DTYPE_UINT16), ("uint32", _capi.DTYPE_UINT32), ("uint64", _capi.DTYPE_UINT64)):
    if isinstance(getattr(torch, _name, None), torch.dtype):
        FROM_TORCH[getattr(torch, _name)] = _code
TO_TORCH = {code: dt for dt, code in FROM_TORCH.items()}


def torch_dtype(code: int, names: dict) -> torch.dtype:
    """The torch dtype of a wire code; UnsupportedDtype if this torch lacks it."""
    dt = TO_TORCH.get(code)
    if dt is None:
        raise UnsupportedDtype(
            f"the channel carries {names.get(code, code)}, which torch {torch.__version__} has no dtype for; "
            "use output='numpy' or 'jax', or publish a signed or wider type",
            _capi.EDTYPE,
        )
    return dt


# The read-only shared memory this process's consumers read batches from
# (payload mappings, slot mappings moved by kept batches, device pools): any
# tensor whose data lies there must never be written. Sorted, disjoint
# [start, end) ranges, as two lists for bisect: a consumer may add one
# range per moved slot, and the check runs on every torch operation.
_starts: list[int] = []
_ends: list[int] = []


def add_range(start: int, length: int) -> None:
    remove_range(start, length)  # ranges stay disjoint
    i = bisect.bisect(_starts, start)
    _starts.insert(i, start)
    _ends.insert(i, start + length)


def remove_range(start: int, length: int) -> None:
    """Takes [start, start + length) out of the guarded ranges, cutting the
    part of a larger range it covers (a kept batch's slot, retired from a
    payload mapping: its memory is private to this process from then on)."""
    end = start + length
    i = max(0, bisect.bisect_right(_starts, start) - 1)
    while i < len(_starts) and _starts[i] < end:
        s, e = _starts[i], _ends[i]
        if e <= start:
            i += 1
            continue
        pieces = [(a, b) for a, b in ((s, start), (end, e)) if a < b]
        _starts[i : i + 1] = [a for a, _ in pieces]
        _ends[i : i + 1] = [b for _, b in pieces]
        i += len(pieces)


def _in_mapping(t: torch.Tensor) -> bool:
    p = t.data_ptr()
    i = bisect.bisect_right(_starts, p) - 1
    return i >= 0 and p < _ends[i]


def _protected(t) -> bool:
    return isinstance(t, ReadOnlyTensor) or (isinstance(t, torch.Tensor) and _starts and _in_mapping(t))


# In-place operators whose names do not end in "_".
_INPLACE_DUNDERS = frozenset(
    "__setitem__ __iadd__ __isub__ __imul__ __itruediv__ __ifloordiv__ __imod__ __ipow__ __imatmul__ "
    "__iand__ __ior__ __ixor__ __ilshift__ __irshift__ __idiv__ __setstate__ __set__".split()
)
# In-place by name but never write the tensor's elements.
_METADATA_ONLY = frozenset(["requires_grad_", "retain_grad"])
# Results that hand the protected memory to numpy: make them read-only.
_TO_NUMPY = frozenset(["numpy", "__array__"])


# Operations that hand out the tensor's memory in a form the guard cannot
# follow (a storage object, a DLPack capsule): whoever holds it could write
# through it, so a protected tensor refuses them outside compiled code.
_MEMORY_EXPORTS = frozenset(["untyped_storage", "storage", "_typed_storage", "__dlpack__"])
_OpOverload = torch._ops.OpOverload
# For each torch.ops OpOverload met: the (position, name) of the arguments its
# schema marks as written (Tensor(a!)); its name ("add_.Tensor") says nothing.
_op_writes: dict = {}


def _schema_writes(op) -> tuple:
    written = _op_writes.get(op)
    if written is None:
        written = tuple(
            (i, a.name)
            for i, a in enumerate(op._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
        _op_writes[op] = written
    return written


def _any_protected(t) -> bool:
    """t, or any tensor of the list or tuple t (torch._foreach_add_([x], 1))."""
    if isinstance(t, (list, tuple)):
        return any(_protected(e) for e in t)
    return _protected(t)


def _first_arg(args, kwargs):
    if args:
        return args[0]
    return kwargs.get("input", kwargs.get("self"))


def _writes_protected(func, name: str, args, kwargs) -> bool:
    """Whether the operation would write into, or hand out writable, the
    memory of a protected tensor."""
    if name in _INPLACE_DUNDERS or (name.endswith("_") and not name.startswith("__") and name not in _METADATA_ONLY):
        if _any_protected(_first_arg(args, kwargs)):
            return True
    elif name in _MEMORY_EXPORTS:
        if _protected(_first_arg(args, kwargs)) and not _compiling():
            return True
    elif "." in name and isinstance(func, _OpOverload):
        # Only overloads are named "op.overload"; torch 2.1's dynamo, which
        # traces this hook, cannot take isinstance of the functions it meets.
        for i, arg_name in _schema_writes(func):
            if _any_protected(args[i] if i < len(args) else kwargs.get(arg_name)):
                return True
    if kwargs.get("inplace") is True and _protected(_first_arg(args, kwargs)):
        return True
    out = kwargs.get("out")
    if out is not None:
        return _any_protected(out)
    return False


if hasattr(torch.Tensor, "untyped_storage"):  # torch >= 2.0; storage() warns there

    def _storage_ptr(t: torch.Tensor) -> int:
        return t.untyped_storage().data_ptr()

else:

    def _storage_ptr(t: torch.Tensor) -> int:
        return t.storage().data_ptr()


_BASE = torch.Tensor._base  # the getter's descriptor: __torch_function__ gets its __get__
_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or torch._dynamo.is_compiling


class ReadOnlyTensor(torch.Tensor):
    """A tensor whose memory must not be written: a batch in read-only shared
    memory (or, for consistency, a batch the consumer assembled). In-place
    operations on it (add_, copy_, zero_, x[i] = v, x += 1, out=x,
    inplace=True, torch.ops overloads that write it, torch._foreach_*_ lists
    holding it) raise ReadOnlyBatchError, and so do untyped_storage(),
    storage(), __dlpack__ and as_subclass to a plain class, which would hand
    the memory out unguarded; other operations work as usual and return
    plain tensors, except views, which stay read-only. Use .clone() for a
    writable copy. `.numpy()` gives a read-only array. docs/PYTHON.md lists
    the writes no hook can see."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        name = getattr(func, "__name__", "")
        if _writes_protected(func, name, args, kwargs):
            raise _refusal(name)
        # Everything below runs with the hook off: the checks call tensor
        # methods (data_ptr) that would come back here otherwise.
        with torch._C.DisableTorchFunctionSubclass():
            ret = func(*args, **kwargs)
            if _compiling() or getattr(func, "__self__", None) is _BASE:
                # Inside a compiled region the write check above is all there
                # is (data pointers are not there to look at); `x._base` is
                # what autograd and dynamo walk, and wrapping it would make a
                # new view whose base is again new, for ever.
                return ret
            if name in _TO_NUMPY and args and _protected(args[0]):
                ret.setflags(write=False)
                return ret
            return _wrap(ret, args, cls)

    def as_subclass(self, cls):
        # A plain tensor over the same memory would carry no guard and fault
        # on its first write; another ReadOnlyTensor class keeps it.
        if isinstance(cls, type) and issubclass(cls, ReadOnlyTensor):
            return torch.Tensor.as_subclass(self, cls)
        raise _refusal("as_subclass")


def _refusal(name: str) -> ReadOnlyBatchError:
    if name in _MEMORY_EXPORTS or name == "as_subclass":
        what = f"{name} would hand out its memory without the write guard"
    else:
        what = name
    return ReadOnlyBatchError(
        f"{what}: this tensor is a tsock batch in read-only shared memory; "
        "write to a copy (x.clone()) or create the Consumer with copy=True"
    )


def _wrap(ret, args, cls):
    if isinstance(ret, torch.Tensor):
        if type(ret) is not torch.Tensor:
            return ret  # an input handed back (x.contiguous()), already guarded
        if _shares_protected(ret, args):
            return ret.as_subclass(cls)
        return ret
    if isinstance(ret, (tuple, list)) and ret and isinstance(ret[0], torch.Tensor):
        return type(ret)([_wrap(r, args, cls) for r in ret])
    return ret


def _shares_protected(ret: torch.Tensor, args) -> bool:
    if _starts and _in_mapping(ret):
        return True
    owned = [a for a in args if isinstance(a, ReadOnlyTensor) and not (_starts and _in_mapping(a))]
    if not owned:
        return False
    p = _storage_ptr(ret)
    return any(_storage_ptr(a) == p for a in owned)


def protect(t: torch.Tensor) -> ReadOnlyTensor:
    """`t` as a ReadOnlyTensor (same memory, no copy)."""
    return t.as_subclass(ReadOnlyTensor)

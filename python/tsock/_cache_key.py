"""The state digest behind a Pipeline's cache key (docs/CACHE.md, "The
key"): what decides the decoded samples is the source's and the stages'
*state* (a dataset's root, a closure's cells, a partial's arguments, a
callable object's attributes) and the *code* of the functions that run,
not their names. state_digest(obj) hashes a pickle of obj in which every
Python function is replaced by its code (bytecode, constants, names),
defaults, closure cells, what it wraps (`__wrapped__`: functools.wraps,
lru_cache) and, up to two calls deep, the globals it uses and the
attributes it reads from a user module's globals (`helpers.scale(x)`);
every class by its name, its package's version and (two levels deep) the
code of its methods and, for a class of a user module, of every user
class of its MRO with their other attributes (constants, a class-level
transform); every module by its name and version. A user module is one
outside the standard library and outside site-packages (or there, but
without a `__version__`): installed packages with a version are named by
it, their code is not followed.

A set is hashed as its sorted elements (their digests where they are not
all strings, bytes or numbers), a torch tensor as its dtype, shape,
strides and bytes, so that the same state gives the same key in every
process (a set pickles in string-hash order, which PYTHONHASHSEED
randomises; torch.save writes a fresh serialization id).

The pickle is never stored or loaded: it is written into a hash, so its
size costs time, not memory (more than MAX_BYTES is refused). An object
that pickle cannot handle (an open file, a lock, a database handle)
raises Unkeyable: the caller then asks the user for version=.
"""

from __future__ import annotations

import dis
import functools
import hashlib
import io
import math
import os
import pickle
import sys
import types

MAX_BYTES = 256 << 20  # a source whose pickle is larger: version= instead
_MISSING = object()
DEPTH = 2  # how many calls deep the globals a function uses are followed


class Unkeyable(Exception):
    """No digest can be made of this object's state."""


class _TooLarge(Unkeyable):
    pass


class _Hasher(io.RawIOBase):
    def __init__(self, budget: list):
        self.h = hashlib.blake2b(digest_size=32)
        self.budget = budget  # [bytes left], shared by the nested digests

    def writable(self):
        return True

    def write(self, b):
        n = len(b)
        self.budget[0] -= n
        if self.budget[0] < 0:
            raise _TooLarge(f"its pickle is larger than {MAX_BYTES >> 20} MiB")
        self.h.update(b)
        return n


def _ref(*parts):  # the callable of every reduce tuple below; never called
    raise AssertionError("a key pickle is hashed, never loaded")


def _package_version(module: str | None) -> str | None:
    top = sys.modules.get((module or "").partition(".")[0])
    v = getattr(top, "__version__", None)
    return str(v) if isinstance(v, str) else None


_SITE = ("site-packages", "dist-packages")
_STDLIB = frozenset(sys.stdlib_module_names) | {"builtins"}


def _user_module(name: str | None) -> bool:
    """Whether the code of module `name` is followed: not the standard
    library, not an installed package with a version (site-packages)."""
    if not name:
        return False
    if name in ("__main__", "__mp_main__"):
        return True
    if name.partition(".")[0] in _STDLIB:
        return False
    f = getattr(sys.modules.get(name), "__file__", None)
    if isinstance(f, str) and any(part in _SITE for part in f.split(os.sep)):
        return _package_version(name) is None
    return True


def _type_name(v) -> str:
    """What stands for a value pickle cannot handle: its type (and, for a
    callable, its name)."""
    return repr((type(v).__module__, type(v).__qualname__, getattr(v, "__qualname__", None)))


def _attribute_chains(co: types.CodeType, out: set) -> set:
    """The dotted reads that start at a global in co and the code nested in
    it: ("helpers", "scale") for `helpers.scale(x)`."""
    chain = None
    for ins in dis.get_instructions(co):
        if ins.opname in ("LOAD_GLOBAL", "LOAD_NAME"):
            if chain is not None and len(chain) > 1:
                out.add(tuple(chain))
            chain = [ins.argval]
        elif chain is not None and ins.opname in ("LOAD_ATTR", "LOAD_METHOD"):
            chain.append(ins.argval)
        elif chain is not None and ins.opname in ("PUSH_NULL", "CACHE", "EXTENDED_ARG"):
            continue
        else:
            if chain is not None and len(chain) > 1:
                out.add(tuple(chain))
            chain = None
    if chain is not None and len(chain) > 1:
        out.add(tuple(chain))
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            _attribute_chains(c, out)
    return out


_DESCRIPTORS = (types.MemberDescriptorType, types.GetSetDescriptorType, types.WrapperDescriptorType,
                types.MethodDescriptorType, types.ClassMethodDescriptorType)  # fmt: skip


def _code(co: types.CodeType) -> tuple:
    """A code object as plain data: what it does, not where it was written
    (no file name or line numbers); set constants sorted (their order
    follows the string hash, which differs between processes)."""
    consts = []
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            consts.append(("code", _code(c)))
        elif isinstance(c, frozenset):
            consts.append(("frozenset", sorted(repr(x) for x in c)))
        else:
            consts.append(("const", repr(c)))
    return (co.co_code, tuple(consts), co.co_names, co.co_varnames, co.co_freevars, co.co_cellvars,
            co.co_argcount, co.co_kwonlyargcount, co.co_flags)  # fmt: skip


def _names(co: types.CodeType) -> set:
    out = set(co.co_names)
    for c in co.co_consts:
        if isinstance(c, types.CodeType):
            out |= _names(c)
    return out


def _by_reference(obj) -> bool:
    """Whether pickle writes obj as a name (its code is then not in it)."""
    try:
        return isinstance(obj.__reduce_ex__(4), str)
    except Exception:  # noqa: BLE001 - an object pickle cannot handle is reported by the pickle itself
        return False


def _tensor(torch, t) -> tuple | None:
    """A torch tensor as its type, dtype, shape, strides, device type and
    bytes (None where they cannot be read: sparse, quantized, meta)."""
    try:
        x = t.detach()
        data = x.resolve_conj().resolve_neg().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        return ("tensor", type(t).__module__, type(t).__qualname__, str(x.dtype), tuple(x.shape), tuple(x.stride()),
                x.device.type, bool(t.requires_grad), data, dict(getattr(t, "__dict__", {})))  # fmt: skip
    except Exception:  # noqa: BLE001 - torch raises many kinds for layouts it cannot view
        return None


class _KeyPickler(pickle.Pickler):
    def __init__(self, file, depth: int, ctx: dict):
        super().__init__(file, protocol=4)
        self.depth, self.ctx = depth, ctx

    def persistent_id(self, obj):
        # Sets are written by the C pickler without asking reducer_override;
        # this is asked for every object first.
        if type(obj) in (set, frozenset):
            return ("set", type(obj).__name__, self._set_items(obj))
        return None

    def reducer_override(self, obj):
        if obj is _ref:
            return NotImplemented
        if isinstance(obj, types.FunctionType):
            return _ref, self._function(obj)
        if isinstance(obj, types.MethodType):
            return _ref, ("method", obj.__func__, obj.__self__)
        if isinstance(obj, types.ModuleType):
            return _ref, ("module", obj.__name__, _package_version(obj.__name__))
        if isinstance(obj, type):
            return _ref, self._class(obj)
        if isinstance(obj, types.CodeType):
            return _ref, ("code", _code(obj))
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, getattr(torch, "Tensor", ())):
            got = _tensor(torch, obj)
            if got is not None:
                return _ref, got
            return NotImplemented
        d = getattr(obj, "__dict__", None)
        if isinstance(d, dict) and "__wrapped__" in d and _by_reference(obj):
            # A wrapper that pickles as its name (functools.lru_cache): what it wraps.
            return _ref, ("wrapped", type(obj).__module__, type(obj).__qualname__, d["__wrapped__"])
        return NotImplemented

    def _set_items(self, items) -> tuple:
        """A set's elements in an order that is the same in every process."""
        kinds = {type(x) for x in items}
        if (
            kinds <= {str}
            or kinds <= {bytes}
            or (kinds <= {int, float, bool} and all(not isinstance(x, float) or not math.isnan(x) for x in items))
        ):
            return ("sorted", tuple(sorted(items)))
        return ("digests", tuple(sorted(self._sub(x, self.depth) for x in items)))

    def _sub(self, obj, depth: int) -> bytes:
        return _digest(obj, depth, self.ctx)

    def _function(self, f) -> tuple:
        name = ("function", f.__module__, f.__qualname__, _package_version(f.__module__))
        if id(f) in self.ctx["active"] or self.depth > DEPTH:
            return name  # recursion, or too deep: by name (and package version)
        self.ctx["active"].add(id(f))
        try:
            cells = []
            for cell in f.__closure__ or ():
                try:
                    cells.append(self._sub(cell.cell_contents, self.depth))
                except ValueError:  # an empty cell
                    cells.append(b"empty")
            used = {}
            if self.depth < DEPTH:
                g = f.__globals__
                for n in sorted(_names(f.__code__)):
                    if n in g and not n.startswith("__"):
                        used[n] = self._value(g[n])
                for chain in sorted(_attribute_chains(f.__code__, set())):
                    target = self._module_attribute(g, chain)
                    if target is not None:
                        used[".".join(target[0])] = self._value(target[1])
            wrapped = vars(f).get("__wrapped__")  # functools.wraps: the function wrapped, too
            return (*name, _code(f.__code__), self._sub((f.__defaults__, f.__kwdefaults__), self.depth),
                    tuple(cells), tuple(sorted(used.items())),
                    None if wrapped is None else self._value(wrapped, 0))  # fmt: skip
        finally:
            self.ctx["active"].discard(id(f))

    def _value(self, v, deeper: int = 1):
        """The digest of a global or attribute one level deeper; a value
        pickle cannot handle stands as its type's name."""
        try:
            return self._sub(v, self.depth + deeper)
        except _TooLarge:
            raise
        except Unkeyable:
            return _type_name(v)

    @staticmethod
    def _module_attribute(g: dict, chain: tuple):
        """For a dotted read whose head is a user module among the globals
        g: (the names up to the value read, that value); None otherwise."""
        obj = g.get(chain[0])
        if not isinstance(obj, types.ModuleType) or not _user_module(obj.__name__):
            return None
        for i, attr in enumerate(chain[1:], 1):
            got = vars(obj).get(attr, _MISSING)
            if got is _MISSING:
                return None
            if not isinstance(got, types.ModuleType):
                return chain[: i + 1], got
            if not _user_module(got.__name__):
                return None  # a package with a version: named by it
            obj = got
        return None  # the chain ends at a module: nothing read from it

    def _members(self, cls, attributes: bool) -> tuple:
        """The code of cls's own methods (and, with attributes, the digests
        of its other non-dunder attributes), one level deeper."""
        out = []
        for k, v in sorted(vars(cls).items()):
            if isinstance(v, (staticmethod, classmethod)):
                code = v.__func__
            elif isinstance(v, property):
                code = (v.fget, v.fset, v.fdel)
            elif isinstance(v, functools.cached_property):
                code = v.func
            else:
                code = v if isinstance(v, types.FunctionType) else None
            if code is not None:
                out.append((k, self._sub(code, self.depth + 1)))
            elif attributes and not (k.startswith("__") and k.endswith("__")) and not isinstance(v, _DESCRIPTORS):
                out.append((k, self._value(v)))
        return tuple(out)

    def _class(self, cls) -> tuple:
        name = ("class", cls.__module__, cls.__qualname__, _package_version(cls.__module__))
        active = self.ctx["active"]
        if id(cls) in active or self.depth >= DEPTH or cls.__module__ == "builtins":
            return name
        if not _user_module(cls.__module__):  # a package's class: its own methods
            active.add(id(cls))
            try:
                return (*name, self._members(cls, False))
            finally:
                active.discard(id(cls))
        # A user class: every class of its MRO (a base's __getitem__ is what
        # runs), with their attributes (SCALE = 10, transform = T(10)).
        mro = [k for k in cls.__mro__ if k is not object and k.__module__ != "builtins"]
        added = {id(k) for k in mro} - active
        active |= added
        try:
            parts = []
            for k in mro:
                base = ("class", k.__module__, k.__qualname__, _package_version(k.__module__))
                if id(k) in added and _user_module(k.__module__):
                    parts.append((*base, self._members(k, True)))
                else:
                    parts.append(base)  # a package's base: named by its version
            return (*name, tuple(parts))
        finally:
            active -= added


def _digest(obj, depth: int, ctx: dict) -> bytes:
    hasher = _Hasher(ctx["budget"])
    try:
        _KeyPickler(hasher, depth, ctx).dump(obj)
    except Unkeyable:
        raise
    except RecursionError:
        raise Unkeyable("it nests too deep to pickle") from None
    except Exception as e:  # noqa: BLE001 - pickle raises many kinds (TypeError, PicklingError, ...)
        raise Unkeyable(f"pickle cannot handle it: {type(e).__name__}: {e}") from None
    return hasher.h.digest()


def state_digest(obj) -> bytes:
    """32 bytes that change when obj's state or code changes (raises
    Unkeyable when they cannot be computed)."""
    return _digest(obj, 0, {"active": set(), "budget": [MAX_BYTES]})

"""The state digest behind a Pipeline's cache key (docs/CACHE.md, "The
key"): what decides the decoded samples is the source's and the stages'
*state* (a dataset's root, a closure's cells, a partial's arguments, a
callable object's attributes) and the *code* of the functions that run,
not their names. state_digest(obj) hashes a pickle of obj in which every
Python function is replaced by its code (bytecode, constants, names),
defaults, closure cells and, up to two calls deep, the globals it uses;
every class by its name, its package's version and (two levels deep) its
methods' code; every module by its name and version.

The pickle is never stored or loaded: it is written into a hash, so its
size costs time, not memory (more than MAX_BYTES is refused). An object
that pickle cannot handle (an open file, a lock, a database handle)
raises Unkeyable: the caller then asks the user for version=.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import sys
import types

MAX_BYTES = 256 << 20  # a source whose pickle is larger: version= instead
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


class _KeyPickler(pickle.Pickler):
    def __init__(self, file, depth: int, ctx: dict):
        super().__init__(file, protocol=4)
        self.depth, self.ctx = depth, ctx

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
        return NotImplemented

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
                        try:
                            used[n] = self._sub(g[n], self.depth + 1)
                        except _TooLarge:
                            raise
                        except Unkeyable:
                            v = g[n]  # a global pickle cannot handle: its type (and, for a callable, name)
                            used[n] = repr((type(v).__module__, type(v).__qualname__, getattr(v, "__qualname__", None)))
            return (*name, _code(f.__code__), self._sub((f.__defaults__, f.__kwdefaults__), self.depth),
                    tuple(cells), tuple(sorted(used.items())))  # fmt: skip
        finally:
            self.ctx["active"].discard(id(f))

    def _class(self, cls) -> tuple:
        name = ("class", cls.__module__, cls.__qualname__, _package_version(cls.__module__))
        if id(cls) in self.ctx["active"] or self.depth >= DEPTH or cls.__module__ == "builtins":
            return name
        self.ctx["active"].add(id(cls))
        try:
            methods = []
            for k, v in sorted(vars(cls).items()):
                for part in (v, getattr(v, "__func__", None), getattr(v, "fget", None)):
                    if isinstance(part, types.FunctionType):
                        methods.append((k, self._sub(part, self.depth + 1)))
            return (*name, tuple(methods))
        finally:
            self.ctx["active"].discard(id(cls))


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

"""How tsock.shared names a pipeline: a reference to the factory the
producer process can import, the fingerprint of the factory and its
arguments (the key trainers share a producer by), and the arguments
pickled for the producer process (docs/SHARED.md, "The key")."""

from __future__ import annotations

import hashlib
import inspect
import io
import json
import os
import pickle
import sys
import types

# The running script: __main__, or __mp_main__ in a child multiprocessing
# started with spawn or forkserver (the same file, another module name).
MAIN_MODULES = ("__main__", "__mp_main__")
MOVE_IT = "define it at the top level of a .py module (say data.py beside the script) and import it from there"


def factory_ref(factory) -> dict:
    """How the producer process finds `factory`: its module and qualified
    name, and for the running script its file. TypeError naming the fix for
    what it cannot import."""
    module = getattr(factory, "__module__", None)
    qualname = getattr(factory, "__qualname__", None)
    if not callable(factory) or module is None or qualname is None:
        raise TypeError(f"tsock.shared needs a function or class as the factory, got {factory!r}")
    fix = (
        "the producer runs in its own process and imports the factory by name: define it at the top level "
        "of a .py module (say data.py beside the script) and import it from there"
    )
    if "<lambda>" in qualname or "<locals>" in qualname:
        raise TypeError(f"tsock.shared: factory {qualname} is a lambda or a nested function; {fix}")
    if _bound_to_an_object(factory):
        raise TypeError(f"tsock.shared: factory {qualname} is a method bound to an object; {fix}")
    ref = {"module": module, "qualname": qualname, "file": None}
    if module in MAIN_MODULES:
        main = sys.modules.get(module)
        name = getattr(getattr(main, "__spec__", None), "name", None)
        if name and name not in MAIN_MODULES:
            # Run as `python -m package.train`: imported by that name, as
            # multiprocessing's spawn does, so that its relative imports
            # work; loaded from its file, it had no package (review 27, N10).
            if _lookup(main, qualname) is not factory:
                raise TypeError(f"tsock.shared: {module}.{qualname} does not name the factory given; {fix}")
            return {"module": name, "qualname": qualname, "file": None, "main": True}
        path = getattr(main, "__file__", None)
        if not path or not path.endswith(".py"):
            raise TypeError(
                f"tsock.shared: factory {qualname} is defined in __main__ of an interactive session or notebook; {fix}"
            )
        ref["file"] = os.path.abspath(path)
    obj = _resolve(ref) if ref["file"] is None else _lookup(sys.modules[module], qualname)
    if obj is not factory:
        raise TypeError(f"tsock.shared: {module}.{qualname} does not name the factory given; {fix}")
    return ref


def _lookup(module, qualname: str):
    obj = module
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    return obj


def _resolve(ref: dict):
    import importlib

    try:
        return _lookup(importlib.import_module(ref["module"]), ref["qualname"])
    except ImportError:
        return None


def _bound_to_an_object(value) -> bool:
    """Whether value is a method bound to an instance (not to a class or a
    module, which its qualified name does say)."""
    owner = getattr(value, "__self__", None)
    return owner is not None and not isinstance(owner, (type, types.ModuleType))


def _canonical(value, where: str):
    """A JSON form of an argument that is the same in every process, or
    TypeError naming name= as the fix."""
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return {"int": str(value)}
    if isinstance(value, float):
        return {"float": value.hex()}
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, (list, tuple)):
        return {type(value).__name__: [_canonical(v, f"{where}[{i}]") for i, v in enumerate(value)]}
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError(f"tsock.shared: {where} is a dict with non-str keys: cannot fingerprint it; pass name=")
        return {"dict": {k: _canonical(v, f"{where}[{k!r}]") for k, v in sorted(value.items())}}
    module, qualname = getattr(value, "__module__", None), getattr(value, "__qualname__", None)
    named = (callable(value) or isinstance(value, type)) and module and qualname and "<" not in qualname
    if named and _bound_to_an_object(value):
        # A bound method's name is its class's: Scale(1).apply and
        # Scale(1000).apply would share one producer (review 24).
        raise TypeError(
            f"tsock.shared: argument {where} is a method bound to an object ({qualname}), whose state its name "
            "does not say; pass name='...' to name the pipeline yourself, or pass a module-level function"
        )
    if named and module in MAIN_MODULES:
        # The running script's: its module name is the same in every script
        # (review 24, F3), its file is not.
        path = getattr(sys.modules.get(module), "__file__", None)
        if not path:
            raise TypeError(f"tsock.shared: argument {where} ({qualname}) is defined in a notebook; {MOVE_IT}")
        return {"ref": f"{os.path.abspath(path)}:{qualname}"}
    if named:
        return {"ref": f"{module}.{qualname}"}
    raise TypeError(
        f"tsock.shared: argument {where} is a {type(value).__name__}, which has no form that is the same in every "
        "process; pass name='...' to name the pipeline yourself (trainers with the same name share it)"
    )


def fingerprint(ref: dict, args: tuple, kwargs: dict) -> str:
    """The key of a factory call: 20 hex digits of blake2b of its canonical form."""
    where = ref["file"] or ref["module"]
    form = {
        "factory": f"{where}:{ref['qualname']}",
        "args": [_canonical(a, f"args[{i}]") for i, a in enumerate(args)],
        "kwargs": {k: _canonical(v, k) for k, v in sorted(kwargs.items())},
    }
    text = json.dumps(form, sort_keys=True, separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=10).hexdigest()


class _NothingOfTheScript(pickle.Pickler):
    """Refuses a function or class of the running script: the producer
    loads the script only when the factory is in it, so it could not
    unpickle them (review 24, F3)."""

    def reducer_override(self, obj):
        module = getattr(obj, "__module__", None)
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and module in MAIN_MODULES:
            raise _ScriptReference(f"{obj.__qualname__} is defined in the running script ({module})")
        return NotImplemented


class _ScriptReference(Exception):
    pass


def _pickled(args: tuple, kwargs: dict, script_loaded: bool) -> bytes:
    """The arguments as the producer gets them; with script_loaded False (the
    factory is not in the running script), nothing of the script."""
    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer) if script_loaded else _NothingOfTheScript(buffer)
    try:
        pickler.dump((tuple(args), dict(kwargs)))
        return buffer.getvalue()
    except _ScriptReference as e:
        raise TypeError(
            f"tsock.shared: an argument refers to {e}, which the producer process does not load (the factory is "
            f"not in the script); {MOVE_IT}"
        ) from None
    except Exception as e:
        raise TypeError(
            f"tsock.shared: the factory's arguments are sent to the producer process pickled, and pickle refused "
            f"them: {type(e).__name__}: {e}"
        ) from None

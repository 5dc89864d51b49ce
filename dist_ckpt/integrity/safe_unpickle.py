"""Loading pickles without running code they were handed.

Checkpoints come from other people and other machines. Every pickle dist_ckpt reads
(``common.pt``, ShardedObject blobs, the DCP ``.metadata``) goes through an allowlist: the
types real Megatron-Core / NeMo / torchtitan checkpoints hold (``argparse.Namespace``, torch
dtypes and sizes, numpy RNG states, paths, the DCP metadata classes). Anything else stops the
load with ``UnsafePickleError`` naming the global, before it is imported or called.

Two explicit opt-ins, for files one trusts:
  * ``add_safe_globals([MyEnum, ...])`` extends the allowlist (like torch's function);
  * ``with trusted_unpickling(): ...`` loads everything unrestricted inside the block.

``torch.save`` files go through torch's own weights-only unpickler with our allowlist added;
plain pickles (DCP ``.metadata``) through a ``pickle.Unpickler`` whose ``find_class`` only
returns allowlisted objects.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import contextvars
import enum
import importlib
import io
import os
import pathlib
import pickle
import re
import threading
import types
from typing import IO, Any, Callable, Dict, Iterable, Iterator, List, Optional, Union

import numpy as np
import torch

from ..core import CheckpointingException, CorruptCheckpointError, UnsafePickleError
from ..runtime.gc_pause import gc_paused

__all__ = [
    "add_safe_globals",
    "get_safe_globals",
    "trusted_unpickling",
    "is_trusted_unpickling",
    "safe_torch_load",
    "safe_pickle_load",
    "plain_pickle_builtins",
    "globals_by_name",
]

_lock = threading.Lock()
# Per context (thread / asyncio task): a trusted block in one thread does not open the door
# for loads running in other threads at the same time.
_trusted: contextvars.ContextVar[bool] = contextvars.ContextVar("dist_ckpt_trusted_unpickling", default=False)
_user_globals: List[Any] = []


def _numpy_globals() -> List[Any]:
    """What ``np.random.get_state()`` and small arrays pickle to, across numpy 1.x and 2.x."""
    out: List[Any] = [np.ndarray, np.dtype]
    core = getattr(np, "_core", None) or np.core
    out += [(core.multiarray._reconstruct, "numpy.core.multiarray._reconstruct")]
    out += [(core.multiarray._reconstruct, "numpy._core.multiarray._reconstruct")]
    out += [(core.multiarray.scalar, "numpy.core.multiarray.scalar")]
    out += [(core.multiarray.scalar, "numpy._core.multiarray.scalar")]
    for name in dir(np.dtypes):
        obj = getattr(np.dtypes, name)
        if isinstance(obj, type) and issubclass(obj, np.dtype):
            out.append(obj)
    return out


def _builtin_globals() -> List[Any]:
    """The allowlist for ``torch.save`` files, on top of torch's weights-only defaults."""
    return [
        argparse.Namespace,
        types.SimpleNamespace,
        collections.OrderedDict,
        collections.defaultdict,
        collections.deque,
        collections.Counter,
        pathlib.Path,
        pathlib.PosixPath,
        pathlib.PurePosixPath,
        pathlib.WindowsPath,
        pathlib.PureWindowsPath,
        (pathlib.PurePosixPath, "pathlib._local.PurePosixPath"),
        (pathlib.PosixPath, "pathlib._local.PosixPath"),
        *_numpy_globals(),
    ]


def add_safe_globals(safe_globals: Iterable[Any]) -> None:
    """Allow more types (classes, or ``(object, "module.name")`` pairs) in every load."""
    with _lock:
        _user_globals.extend(safe_globals)


def get_safe_globals() -> List[Any]:
    """Everything dist_ckpt allows on top of torch's weights-only defaults."""
    return _builtin_globals() + list(_user_globals)


@contextlib.contextmanager
def trusted_unpickling() -> Iterator[None]:
    """Within this block, pickles load unrestricted (they may run code: trust the files).

    It applies to the calling thread (context) only; loads running elsewhere stay restricted.
    """
    token = _trusted.set(True)
    try:
        yield
    finally:
        _trusted.reset(token)


def is_trusted_unpickling() -> bool:
    return _trusted.get()


_OPT_IN_HINT = (
    "If you trust this checkpoint, allow the type with dist_ckpt.add_safe_globals([<type>]) or load "
    "inside `with dist_ckpt.trusted_unpickling():` (which lets the file run code)."
)
_GLOBAL_RE = re.compile(
    r"GLOBAL (\S+) was not an allowed global|unsupported GLOBAL (\S+) whose module"
    r"|unrecognized function (.+?)(?: which|$)|but got (.+)$",
    re.MULTILINE,
)


_REFUSAL_MARKERS = ("not an allowed global", "unrecognized function", "Can only create new object", "is blocked")
_LOAD_ERRORS = (Exception,)  # anything a damaged pickle makes the unpickler raise


def _translate(what: str, exc: BaseException) -> Exception:
    """Our error for a failed unpickling: refused global, or damaged data."""
    # torch wraps the useful line between boilerplate paragraphs: keep the informative one
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith(("Weights only load failed", "Check the documentation", "Please file"))]
    detail = (useful or lines or [""])[0]
    if isinstance(exc, pickle.UnpicklingError) and any(m in str(exc) for m in _REFUSAL_MARKERS):
        match = _GLOBAL_RE.search(str(exc))
        name = next((g for g in match.groups() if g), None) if match else None
        named = f"references {name!r}, which is not in dist_ckpt's allowlist" if name else f"was refused ({detail})"
        return UnsafePickleError(f"{what} {named}; nothing from it was executed. {_OPT_IN_HINT}")
    return CorruptCheckpointError(
        f"{what} is truncated or corrupt and cannot be unpickled ({type(exc).__name__}: {detail})"
    )


# Enums that real Megatron-LM / Megatron-Core args hold (e.g. AttnBackend). Rebuilding an
# enum member is a lookup by value, so they are allowed - but only these, by their full names:
# a module a file names is never imported because the file names it.
_FRAMEWORK_ENUMS = frozenset(
    [f"megatron.core.transformer.enums.{n}" for n in
     ("ModelType", "LayerType", "AttnType", "AttnMaskType", "AttnBackend", "CudaGraphScope")]
    + [f"megatron.core.enums.{n}" for n in ("ModelType", "Fp8Recipe", "Fp4Recipe")]
)


def _allowed_enums(names: Iterable[str]) -> List[Any]:
    allowed: List[Any] = []
    for full in names:
        if full not in _FRAMEWORK_ENUMS:
            continue
        module_name, _, attr = full.rpartition(".")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError):
            continue
        if isinstance(obj, type) and issubclass(obj, enum.Enum):
            allowed.append((obj, full))
    return allowed


# Globals torch's weights-only unpickler allows that build an object of a size the file
# chooses without holding its bytes (``bytearray(2**40)``): refused before torch.load runs.
_ALLOCATING_GLOBALS = frozenset({"builtins bytearray", "__builtin__ bytearray", "builtins range", "__builtin__ range"})


def _refuse_allocating_globals(source: IO[bytes], what: str) -> None:
    """Scan the pickle of a torch.save zip (``*/data.pkl``) for allocating globals. torch's
    weights-only unpickler resolves GLOBAL opcodes only, so looking at those is complete."""
    import pickletools
    import zipfile

    source.seek(0)
    try:
        with zipfile.ZipFile(source) as zf:
            names = [n for n in zf.namelist() if n.endswith("data.pkl")]
            pickled = zf.read(names[0]) if len(names) == 1 else None
    except Exception:  # noqa: BLE001 - not a zip (legacy format) or damaged (EOFError, zlib.error...): torch.load reports it
        pickled = None
    finally:
        source.seek(0)
    # GLOBAL names are plain text in the (decompressed) pickle: without these words, nothing to scan.
    if pickled is None or (b"bytearray" not in pickled and b"range" not in pickled):
        return
    try:
        found = next((arg for opcode, arg, _ in pickletools.genops(pickled)
                      if opcode.name == "GLOBAL" and arg in _ALLOCATING_GLOBALS), None)
    except (ValueError, IndexError, EOFError):
        return  # damaged pickle: torch.load reports it
    if found is not None:
        raise UnsafePickleError(
            f"{what} calls {found.replace(' ', '.')} (it would allocate memory the file chooses); nothing "
            f"from it was executed. {_OPT_IN_HINT}"
        )


def safe_torch_load(source: Union[str, pathlib.Path, IO[bytes], bytes], what: str,
                    extra_globals: Iterable[Any] = (), map_location: Any = "cpu", **kwargs: Any) -> Any:
    """``torch.load`` with the allowlist (and ``extra_globals``, the caller's own classes for this
    load only); ``what`` names the file/item in errors. Tensors come back on the CPU unless
    ``map_location`` (torch's meaning) says otherwise.

    The allowlist belongs to this call alone: torch's weights-only defaults, the entries a user
    gave torch's own ``add_safe_globals`` (read, never changed), dist_ckpt's and the caller's,
    resolved by a restricted unpickler made for this call (``_restricted_pickle_module``).
    torch's ``safe_globals`` context manager would add to and remove from one process-global
    list: a reader thread leaving it removed the entries another thread was unpickling with,
    and the user's own entries with them."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = io.BytesIO(source)
    if is_trusted_unpickling():
        return torch.load(source, map_location=map_location, weights_only=False, **kwargs)
    if isinstance(source, (str, pathlib.Path)):
        source = io.BytesIO(pathlib.Path(source).read_bytes())
    _refuse_allocating_globals(source, what)
    module = _restricted_pickle_module(torch_load_allowlist(extra_globals))
    try:
        return _torch_load_with(module, source, map_location, **kwargs)
    except _LOAD_ERRORS as e:
        raise _translate(what, e) from None


def torch_load_allowlist(extra_globals: Iterable[Any] = ()) -> Dict[str, Any]:
    """Full name -> object of everything one ``safe_torch_load`` may resolve, built for it."""
    return {
        **_torch_default_globals(),
        **globals_by_name(torch.serialization.get_safe_globals()),
        **globals_by_name(get_safe_globals()),
        **globals_by_name(extra_globals),
    }


def _torch_default_globals() -> Dict[str, Any]:
    """What torch's weights-only unpickler allows by default (tensors, storages, dtypes, sizes,
    devices, ordered dicts), with ``bytearray`` bounded to the bytes a file holds."""
    from torch import _weights_only_unpickler

    allowed = dict(_weights_only_unpickler._get_allowed_globals())
    allowed["builtins.bytearray"] = _bounded_bytearray
    return allowed


def _bounded_bytearray(source: Any = b"", *args: Any) -> bytearray:
    """``bytearray`` of bytes or items a file holds, never of a size it names."""
    if isinstance(source, int):
        raise pickle.UnpicklingError("bytearray() of a size was refused")
    return bytearray(source, *args)


def _restricted_pickle_module(allowed: Dict[str, Any]) -> types.ModuleType:
    """A pickle module for ``torch.load(pickle_module=...)`` whose unpickler resolves only
    ``allowed`` (and the framework enums): made per call, so no other load sees its list."""

    class Unpickler(_RestrictedUnpickler):
        def __init__(self, file: IO[bytes], **kwargs: Any) -> None:
            super().__init__(file, allowed, **kwargs)

    module = types.ModuleType("dist_ckpt_restricted_pickle")
    module.Unpickler = Unpickler  # type: ignore[attr-defined]
    module.load = lambda file, **kwargs: Unpickler(file, **kwargs).load()  # type: ignore[attr-defined]
    module.UnpicklingError = pickle.UnpicklingError  # type: ignore[attr-defined]
    return module


def _torch_load_with(module: types.ModuleType, source: IO[bytes], map_location: Any, **kwargs: Any) -> Any:
    """``torch.load`` through ``module``. Where ``TORCH_FORCE_WEIGHTS_ONLY_LOAD`` is set, torch
    refuses any pickle module (its own global allowlist would be the only way): the zip file
    is then read by torch's loader under the same restricted module, which is as strict."""
    if os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "0").lower() not in ("1", "y", "yes", "true"):
        return torch.load(source, map_location=map_location, weights_only=False, pickle_module=module, **kwargs)
    source.seek(0)
    with torch.serialization._open_zipfile_reader(source) as zip_file:
        return torch.serialization._load(zip_file, map_location, module, encoding="utf-8", **kwargs)


def plain_pickle_builtins() -> Dict[str, Any]:
    """Globals any plain pickle of metadata may use: torch sizes, dtypes and layouts, ordered
    dicts, paths, and bounded builtins (no ``bytearray`` or ``range``: they would build objects
    of any size a file asks for). Format modules add their own classes (``strategies.dcp.files``)."""
    allowed: Dict[str, Any] = {"torch.Size": torch.Size, "torch.serialization._get_layout": torch.serialization._get_layout}
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[f"torch.{name}"] = obj
    for obj in (collections.OrderedDict, pathlib.PosixPath, pathlib.PurePosixPath, pathlib.Path, pathlib.WindowsPath):
        allowed[f"{obj.__module__}.{obj.__qualname__}"] = obj
        allowed[f"pathlib.{obj.__qualname__}"] = obj
    allowed["copyreg._reconstructor"] = _object_reconstructor
    allowed["builtins.object"] = object
    allowed["builtins.set"] = _bounded(set)
    allowed["builtins.frozenset"] = _bounded(frozenset)
    allowed["builtins.slice"] = slice
    allowed["builtins.complex"] = complex
    return allowed


def _bounded(container: type) -> Any:
    """``set``/``frozenset`` of the items a file holds (a list or tuple), never of an iterator
    that could produce more than the file's size."""

    def build(items: Any = ()) -> Any:
        if not isinstance(items, (list, tuple, set, frozenset)):
            raise pickle.UnpicklingError(f"{container.__name__}() of a {type(items).__name__} was refused")
        return container(items)

    return build


def _object_reconstructor(cls: type, base: type, state: Any) -> Any:
    """``copyreg._reconstructor`` for plain classes only (``base`` object): with another base
    (``bytearray``) it would allocate what the file asks."""
    if base is not object:
        raise pickle.UnpicklingError(f"copyreg._reconstructor with base {base!r} was refused")
    return __import__("copyreg")._reconstructor(cls, base, state)


class _RestrictedUnpickler(pickle.Unpickler):
    """The C unpickler, resolving only allowlisted globals (and the framework enums); tensors
    a pickler took out as persistent ids come from ``persistent_load``."""

    def __init__(self, file: IO[bytes], allowed: Dict[str, Any],
                 persistent_load: Optional[Callable[[Any], Any]] = None,
                 refused: Optional[Callable[[str], Optional[Exception]]] = None, **kwargs: Any) -> None:
        super().__init__(file, **kwargs)
        self._allowed = allowed
        self._refused = refused
        if persistent_load is not None:
            self.persistent_load = persistent_load  # type: ignore[method-assign]

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in self._allowed:
            return self._allowed[full]
        enums = _allowed_enums([full])
        if enums:
            return enums[0][0]
        instead = self._refused(full) if self._refused is not None else None
        if instead is not None:
            raise instead
        raise pickle.UnpicklingError(f"GLOBAL {full} was not an allowed global")


class _TrustedUnpickler(pickle.Unpickler):
    """Unrestricted (``trusted_unpickling``), but for the ``stand_ins`` a format module names (a
    class that reads every torch release's state): they serve trusted loads as restricted ones."""

    def __init__(self, file: IO[bytes], stand_ins: Dict[str, Any]) -> None:
        super().__init__(file)
        self._stand_ins = stand_ins

    def find_class(self, module: str, name: str) -> Any:
        found = self._stand_ins.get(f"{module}.{name}")
        return found if found is not None else super().find_class(module, name)


def globals_by_name(entries: Iterable[Any]) -> Dict[str, Any]:
    """``{"module.qualname": object}`` for allowlist entries as ``add_safe_globals`` takes them
    (objects, or ``(object, "module.name")`` pairs)."""
    named: Dict[str, Any] = {}
    for entry in entries:
        obj, name = entry if isinstance(entry, tuple) else (entry, f"{entry.__module__}.{entry.__qualname__}")
        named.setdefault(name, obj)
    return named


@gc_paused()
def safe_pickle_load(file: IO[bytes], what: str, allowed: Dict[str, Any],
                     persistent_load: Optional[Callable[[Any], Any]] = None,
                     refused: Optional[Callable[[str], Optional[Exception]]] = None,
                     stand_ins: Optional[Dict[str, Any]] = None) -> Any:
    """``pickle.load`` that resolves only the globals in ``allowed`` (full name -> object) and
    those of ``add_safe_globals``; ``what`` names the file in errors. Nothing else is imported
    or called. ``persistent_load`` resolves the pickle's persistent ids (e.g. tensors stored
    beside it). ``stand_ins`` resolve names to other objects, in trusted loads too (a class that
    reads every torch release's state of the one it stands in for). ``refused(name)`` may name a
    better error than an unsafe pickle for a global outside the allowlist (a format module knows
    a newer release's class when it sees one); our own errors raised while unpickling (an
    allowlisted class refusing a state it does not know) pass through as they are. Without
    garbage collection while it runs (``gc_paused``: an index of many chunks is hundreds of
    thousands of small objects)."""
    if is_trusted_unpickling():
        unpickler = _TrustedUnpickler(file, stand_ins or {})
        if persistent_load is not None:
            unpickler.persistent_load = persistent_load  # type: ignore[method-assign]
        return unpickler.load()
    allowed = {**globals_by_name(get_safe_globals()), **allowed, **(stand_ins or {})}
    try:
        return _RestrictedUnpickler(file, allowed, persistent_load, refused).load()
    except CheckpointingException:
        raise  # a class the allowlist resolves, or ``refused``, said what is wrong: nothing to translate
    except _LOAD_ERRORS as e:
        raise _translate(what, e) from None

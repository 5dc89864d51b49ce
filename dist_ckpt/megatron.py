"""Megatron-LM on dist_ckpt, without changing Megatron-LM's imports.

``dist_ckpt.megatron.install()`` puts an import hook first on ``sys.meta_path`` that resolves
``megatron.core.dist_checkpointing`` and every module under it to dist_ckpt's module of the same
path (``megatron.core.dist_checkpointing.strategies.torch`` is ``dist_ckpt.strategies.torch``):
the same module objects, not copies, so a ``ShardedTensor`` built by Megatron-Core's models is
dist_ckpt's, ``isinstance`` checks agree everywhere, and ``mock.patch("megatron.core.
dist_checkpointing.X.y")`` patches dist_ckpt. Call it once per process before anything imports
``megatron`` - at the top of the training script (``pretrain_gpt.py``), or for every process of a
job through a ``sitecustomize`` / ``usercustomize`` module::

    import dist_ckpt.megatron
    dist_ckpt.megatron.install()
    from megatron.training import pretrain  # Megatron-LM as it is

Called after Megatron-Core's package was imported, it re-points ``sys.modules`` too, but the
modules that imported names from it before keep Megatron-Core's objects (a warning says so).
A module dist_ckpt does not have (``tensor_aware_state_dict`` until the local checkpoint tier
lands) fails to import with ``ModuleNotFoundError`` naming it, not by mixing in Megatron-Core's.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import logging
import sys
import types
from typing import Optional, Sequence

__all__ = ["MEGATRON_PACKAGE", "install", "uninstall", "installed"]

logger = logging.getLogger(__name__)

MEGATRON_PACKAGE = "megatron.core.dist_checkpointing"
OURS = "dist_ckpt"


def _ours(fullname: str) -> str:
    return OURS + fullname[len(MEGATRON_PACKAGE):]


def _is_megatrons(fullname: str) -> bool:
    return fullname == MEGATRON_PACKAGE or fullname.startswith(MEGATRON_PACKAGE + ".")


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``megatron.core.dist_checkpointing[.X]`` and loads it as ``dist_ckpt[.X]``.

    The module the import system makes from our spec is a placeholder: ``exec_module`` puts
    dist_ckpt's module into ``sys.modules`` under the Megatron name, and the import system
    returns what ``sys.modules`` holds after ``exec_module`` - so dist_ckpt's module keeps its
    own ``__name__`` and ``__spec__``.
    """

    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[types.ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        if not _is_megatrons(fullname):
            return None
        if importlib.util.find_spec(_ours(fullname)) is None:
            raise ModuleNotFoundError(
                f"No module named {fullname!r}: dist_ckpt has no {_ours(fullname)!r} "
                f"(dist_ckpt.megatron.install() maps {MEGATRON_PACKAGE} to dist_ckpt)", name=fullname)
        return importlib.util.spec_from_loader(fullname, self, is_package=True)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        return types.ModuleType(spec.name)

    def exec_module(self, module: types.ModuleType) -> None:
        sys.modules[module.__name__] = importlib.import_module(_ours(module.__name__))


_finder = _AliasFinder()


def installed() -> bool:
    return _finder in sys.meta_path


def install() -> None:
    """Resolve ``megatron.core.dist_checkpointing`` (and every submodule) to dist_ckpt (module
    doc). Idempotent."""
    if not installed():
        sys.meta_path.insert(0, _finder)
    stale = sorted(name for name, module in list(sys.modules.items())
                   if _is_megatrons(name) and getattr(module, "__name__", "").split(".")[0] != OURS)
    for name in stale:
        del sys.modules[name]
    if stale:
        logger.warning("dist_ckpt.megatron.install() after %s was imported: modules that imported names from it "
                       "before keep Megatron-Core's objects; call install() before importing megatron",
                       MEGATRON_PACKAGE)
        for name in stale:
            try:
                importlib.import_module(name)
            except ImportError:  # a module dist_ckpt does not have: it stays unimported
                pass
    parent = sys.modules.get(MEGATRON_PACKAGE.rsplit(".", 1)[0])
    if parent is not None and MEGATRON_PACKAGE in sys.modules:
        setattr(parent, MEGATRON_PACKAGE.rsplit(".", 1)[1], sys.modules[MEGATRON_PACKAGE])


def uninstall() -> None:
    """Remove the hook and the aliases (tests; a process that installed it keeps the objects
    its modules already imported)."""
    if installed():
        sys.meta_path.remove(_finder)
    for name in [n for n, m in sys.modules.items() if _is_megatrons(n) and getattr(m, "__name__", "").startswith(OURS)]:
        del sys.modules[name]

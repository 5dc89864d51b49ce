"""Partial loads: the part of a state dict that ``include`` / ``exclude`` patterns select.

A fine-tune that starts from another run's checkpoint loads the model and not the optimizer,
the data loader's position or the step counter (torchtitan's ``exclude_from_loading`` and
``initial_load_model_only``; Megatron-LM's ``--no-load-optim``, ``--no-load-rng``,
``--finetune``). Patterns are shell-style (``fnmatch``) and match an entry's path in the state
dict, its keys joined by dots (``optimizer.state.exp_avg``), or any prefix of it (``optimizer``
selects the whole sub-tree), or the key of a ShardedTensor / ShardedObject there
(``decoder.layers.0.mlp.weight``). A list or tuple is selected or left out whole (dropping some
of its items would shift the others).

An entry is kept when ``include`` is None or one of its patterns matches, and no ``exclude``
pattern matches. What is not selected is neither read nor returned: the caller keeps its own
values for it.
"""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Any, Iterable, List, Optional, Sequence, Tuple

from ..mapping import ShardedBase
from .save_policies import InvalidPolicyError

__all__ = ["Selection"]


def _patterns(name: str, patterns: Optional[Iterable[str]]) -> Optional[Tuple[str, ...]]:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    out = tuple(patterns)
    if any(not isinstance(p, str) or not p for p in out):
        raise InvalidPolicyError(f"{name} must be a list of non-empty patterns (strings), got {list(out)!r}")
    return out


class Selection:
    """``include`` (None: everything) minus ``exclude``."""

    def __init__(self, include: Optional[Sequence[str]] = None, exclude: Optional[Sequence[str]] = None) -> None:
        self.include = _patterns("include", include)
        self.exclude = _patterns("exclude", exclude) or ()

    @property
    def everything(self) -> bool:
        return self.include is None and not self.exclude

    def __repr__(self) -> str:
        return f"Selection(include={self.include!r}, exclude={list(self.exclude)!r})"

    @staticmethod
    def _matches(patterns: Iterable[str], path: str, value: Any) -> bool:
        key = value.key if isinstance(value, ShardedBase) else None
        return any(fnmatchcase(path, p) or (key is not None and fnmatchcase(key, p)) for p in patterns)

    def apply(self, state_dict: Any) -> Tuple[Any, List[str]]:
        """The selected part of ``state_dict`` (new dicts; values are not copied) and the paths
        left out."""
        if self.everything:
            return state_dict, []
        dropped: List[str] = []
        return self._select(state_dict, "", self.include is None, dropped), dropped

    def _select(self, node: Any, path: str, included: bool, dropped: List[str]) -> Any:
        """``node`` at ``path`` with what is not selected left out; ``_LEFT_OUT`` when nothing
        of it is (the root is always returned, if empty)."""
        if path and self._matches(self.exclude, path, node):
            dropped.append(path)
            return _LEFT_OUT
        if path and not included and self.include is not None and self._matches(self.include, path, node):
            included = True
        if isinstance(node, dict):
            kept = {}
            for key, value in node.items():
                child = self._select(value, f"{path}.{key}" if path else str(key), included, dropped)
                if child is not _LEFT_OUT:
                    kept[key] = child
            return kept if kept or not path or (included and not node) else _LEFT_OUT
        if included:
            return node
        dropped.append(path)
        return _LEFT_OUT


_LEFT_OUT: Any = object()

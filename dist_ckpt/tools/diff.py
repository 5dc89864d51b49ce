"""``dist-ckpt diff A B``: compare two checkpoints of any formats, one tensor in memory at a time.

Reports keys only in one, dtype or shape differences, and for every tensor present in both
with the same dtype and shape whether it is bit-exact, else its largest absolute difference
(in float64) and how many elements differ. Common state: keys only in one and keys whose
values differ. Each tensor is read whole from each side (as ``export`` does), compared and
dropped before the next.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
import reprlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

import torch

from ..dict_utils import diff as diff_dicts
from ..runtime.timing import phase
from ..serialization import load_common_state_dict, load_tensors_metadata
from ..storage.object_store import localize
from ..validation import verify_checkpoint_and_load_strategy
from .streaming import read_whole_tensor
from .wording import counted

__all__ = ["TensorDifference", "DiffReport", "diff_checkpoints", "format_report"]


@dataclass
class TensorDifference:
    key: str
    what: str  # "dtype", "shape" or "values"
    detail: str
    max_abs_diff: Optional[float] = None
    elements_differing: Optional[int] = None


@dataclass
class DiffReport:
    only_in_a: List[str] = field(default_factory=list)
    only_in_b: List[str] = field(default_factory=list)
    differences: List[TensorDifference] = field(default_factory=list)
    identical: List[str] = field(default_factory=list)
    common_only_in_a: List[str] = field(default_factory=list)
    common_only_in_b: List[str] = field(default_factory=list)
    common_differing: List[str] = field(default_factory=list)
    #: (a's value, b's value) of each key of ``common_differing``, as short reprs
    common_values: Dict[str, Tuple[str, str]] = field(default_factory=dict)
    tensors_only: bool = False  # the common state was not compared

    @property
    def same(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.differences or self.common_only_in_a
                    or self.common_only_in_b or self.common_differing)


def _values_difference(key: str, a: torch.Tensor, b: torch.Tensor) -> Optional[TensorDifference]:
    if a.view(torch.uint8).equal(b.view(torch.uint8)) if a.numel() else True:
        return None
    if a.dtype.is_floating_point or a.dtype.is_complex:
        fa, fb = a.to(torch.float64), b.to(torch.float64)
        differs = ~((fa == fb) | (fa.isnan() & fb.isnan()))
        delta = (fa - fb).abs()
        finite = delta[differs & delta.isfinite()]
        max_abs = float(finite.max()) if finite.numel() else math.inf
    elif a.dtype == torch.bool:
        differs = a != b
        max_abs = 1.0
    else:
        differs = a != b
        max_abs = float((a.to(torch.float64) - b.to(torch.float64)).abs().max())
    count = int(differs.sum())
    if count == 0:  # the same numbers with other bits (e.g. -0.0 vs 0.0, NaN payloads)
        return TensorDifference(key, "values", "equal values, different bits", 0.0, 0)
    return TensorDifference(key, "values", f"{count} of {a.numel()} elements differ, max |a-b| = {max_abs:.6g}",
                            max_abs, count)


def diff_checkpoints(a: Union[str, os.PathLike], b: Union[str, os.PathLike], *,
                     storage_options: Optional[dict] = None,
                     progress: Optional[Callable[[Iterable], Iterable]] = None,
                     tensors_only: bool = False) -> DiffReport:
    """Compare checkpoints ``a`` and ``b`` (paths or URLs, any format dist_ckpt reads);
    ``tensors_only``: not their common state (an HF export has none to compare)."""

    with phase("download" if any("://" in str(x) for x in (a, b)) else "open"):
        dir_a, dir_b = localize(a, storage_options), localize(b, storage_options)
    with phase("metadata"):
        loader_a, _ = verify_checkpoint_and_load_strategy(dir_a)
        loader_b, _ = verify_checkpoint_and_load_strategy(dir_b)
        meta_a, meta_b = load_tensors_metadata(dir_a, loader_a), load_tensors_metadata(dir_b, loader_b)
    report = DiffReport(sorted(set(meta_a) - set(meta_b)), sorted(set(meta_b) - set(meta_a)))
    to_compare: List[Tuple[str, Any, Any]] = []
    for key in sorted(set(meta_a) & set(meta_b)):
        sa, sb = meta_a[key], meta_b[key]
        if sa.dtype != sb.dtype:
            report.differences.append(TensorDifference(key, "dtype", f"{sa.dtype} vs {sb.dtype}"))
        elif tuple(sa.global_shape) != tuple(sb.global_shape):
            report.differences.append(TensorDifference(key, "shape", f"{tuple(sa.global_shape)} vs {tuple(sb.global_shape)}"))
        else:
            to_compare.append((key, sa, sb))
    with phase("tensors"):
        for key, sa, sb in (progress(to_compare) if progress else to_compare):
            ta = read_whole_tensor(loader_a, dir_a, key, tuple(sa.global_shape), sa.dtype)
            tb = read_whole_tensor(loader_b, dir_b, key, tuple(sb.global_shape), sb.dtype)
            difference = _values_difference(key, ta, tb)
            del ta, tb  # one tensor pair in memory at a time
            if difference is None:
                report.identical.append(key)
            else:
                report.differences.append(difference)
    report.tensors_only = tensors_only
    if tensors_only:
        return report
    with phase("common state"):
        common_a, common_b = load_common_state_dict(dir_a), load_common_state_dict(dir_b)
        only_a, only_b, differing = diff_dicts(common_a, common_b)
    report.common_only_in_a = [".".join(map(str, k)) for k in only_a]
    report.common_only_in_b = [".".join(map(str, k)) for k in only_b]
    for mismatch in differing:
        key = ".".join(map(str, mismatch[0]))
        report.common_differing.append(key)
        report.common_values[key] = (_short(_at(common_a, mismatch[0])), _short(_at(common_b, mismatch[0])))
    return report


_SHORT = reprlib.Repr()
_SHORT.maxstring = _SHORT.maxother = 60


def _short(value: Any) -> str:
    """A value for one line of the report (tensors by dtype and shape, long reprs cut)."""
    if isinstance(value, torch.Tensor):
        return f"tensor({str(value.dtype).replace('torch.', '')}, {tuple(value.shape)})"
    return _SHORT.repr(value)


def _at(tree: Any, path: Tuple[Any, ...]) -> Any:
    for part in path:
        tree = tree[part]
    return tree


def format_report(a: str, b: str, r: DiffReport) -> str:
    """What ``dist-ckpt diff`` prints: one line per difference, then a summary line."""
    lines = []
    lines += [f"only in {a}: {k}" for k in r.only_in_a]
    lines += [f"only in {b}: {k}" for k in r.only_in_b]
    lines += [f"differs in {d.what}: {d.key}: {d.detail}" for d in r.differences]
    lines += [f"common state only in {a}: {k}" for k in r.common_only_in_a]
    lines += [f"common state only in {b}: {k}" for k in r.common_only_in_b]
    for key in r.common_differing:
        value_a, value_b = r.common_values.get(key, ("?", "?"))
        lines.append(f"common state differs: {key}: {value_a} in {a}, {value_b} in {b}")
    lines.append(f"{'same' if r.same else 'DIFFERENT'}: {counted(len(r.identical), 'tensor')} bit-exact, "
                 f"{len(r.differences)} differ, {len(r.only_in_a)} only in {a}, {len(r.only_in_b)} only in {b}"
                 + ("; common state not compared (--tensors-only)" if r.tensors_only else ""))
    return "\n".join(lines)


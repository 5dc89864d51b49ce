"""Traversal of nested state dicts (dicts and lists nested to any depth).

The same helpers (and names) as Megatron-Core's ``dict_utils``, so code that manipulates
sharded state dicts ports unchanged.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, Iterator, List, Tuple

import torch

__all__ = [
    "extract_matching_values",
    "nested_values",
    "nested_items_iter",
    "dict_map",
    "dict_map_with_key",
    "map_reduce",
    "inspect_types",
    "dict_list_map_inplace",
    "dict_list_map_outplace",
    "merge",
    "diff",
    "tensors_bitwise_equal",
]

Nested = Any  # a dict or list of dicts, lists and leaves, arbitrarily deep


def extract_matching_values(
    x: Nested, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> Tuple[Nested, Nested]:
    """Split ``x`` into (matching, non-matching) nested structures by a leaf predicate.

    Exactly Megatron-Core's rules, because the non-matching side of a state dict is what goes
    to ``common.pt`` and both libraries must write and read the same thing:

    - an empty dict or list (an optimizer's ``state`` at step 0) is a value of its own and
      stays on the non-matching side; it is never dropped;
    - a non-empty container whose leaves all match appears on the matching side only;
    - lists keep their order, compacted (``[ShardedTensor, None, 5]`` gives ``[None, 5]``);
      with ``return_lists_as_dicts`` the matching side has ``{index: value}`` dicts instead,
      so that positions can be restored on load.
    """

    if isinstance(x, dict):
        items: Any = x.items()
    elif isinstance(x, list):
        items = enumerate(x)
    else:
        raise TypeError(f"Unexpected top-level object type: {type(x)}")
    # (key, value) pairs first, containers built once: a state dict of 10^5 tensors is one
    # flat dict, and a call per value to place it cost as much as the rest of the split
    matching: List[Tuple[Any, Any]] = []
    nonmatching: List[Tuple[Any, Any]] = []
    for k, v in items:
        if type(v) is dict or type(v) is list or isinstance(v, (dict, list)):
            if not v:
                nonmatching.append((k, v))  # an empty container is a value: keep it
                continue
            m, nm = extract_matching_values(v, predicate, return_lists_as_dicts)
            if m:
                matching.append((k, m))
            if nm:
                nonmatching.append((k, nm))
        elif predicate(v):
            matching.append((k, v))
        else:
            nonmatching.append((k, v))
    if isinstance(x, dict) or return_lists_as_dicts:
        return dict(matching), dict(nonmatching)
    return [v for _, v in matching], [v for _, v in nonmatching]


def nested_items_iter(x: Nested) -> Iterator[Tuple[Any, Any, Any]]:
    """Yield (container, key-or-index, leaf) for every leaf of ``x`` (Megatron-Core's triples:
    ``container[key] = new`` replaces the leaf)."""
    items = x.items() if isinstance(x, dict) else enumerate(x)
    for k, v in items:
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def nested_values(x: Nested) -> Iterator[Any]:
    """Yield every leaf of ``x``."""
    for _, _, v in nested_items_iter(x):
        yield v


def dict_map(f: Callable[[Any], Any], d: Nested) -> None:
    """Replace every leaf ``v`` of ``d`` by ``f(v)``, in place."""
    for container, k, v in list(nested_items_iter(d)):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: Nested) -> None:
    """Replace every leaf ``v`` (at key or index ``k`` of its container) by ``f(k, v)``, in place."""
    for container, k, v in list(nested_items_iter(d)):
        container[k] = f(k, v)


def map_reduce(xs: Iterable[Any], key_fn: Callable[[Any], Any] = lambda x: x,
               value_fn: Callable[[Any], Any] = lambda x: x, reduce_fn: Callable[[List[Any]], Any] = lambda x: x
               ) -> Dict[Any, Any]:
    """Group ``value_fn(x)`` by ``key_fn(x)`` and reduce each group's list with ``reduce_fn``
    (``more_itertools.map_reduce``'s interface)."""
    groups: Dict[Any, List[Any]] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}


def inspect_types(x: Any, prefix: Tuple = (), indent: int = 4) -> None:
    """Print the nested structure of ``x`` with the type of each leaf (for debugging)."""
    pad = " " * indent * len(prefix)
    if isinstance(x, dict):
        print()
        for k, v in x.items():
            print(f"{pad}> {k}: ", end="")
            inspect_types(v, prefix + (k,), indent)
    elif isinstance(x, list):
        print()
        for i, v in enumerate(x):
            print(f"{pad}- {i}: ", end="")
            inspect_types(v, prefix + (i,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"Tensor of shape {tuple(x.shape)}")
    else:
        try:
            text = str(x)
        except Exception:  # noqa: BLE001 - any object may be printed
            text = "<no str>"
        print(f"{type(x).__name__}: {text[:30]}")


def dict_list_map_inplace(f: Callable[[Any], Any], x: Nested) -> Nested:
    """Replace every leaf ``v`` of ``x`` by ``f(v)``, in place; returns ``x``."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
    elif isinstance(x, list):
        x[:] = (dict_list_map_inplace(f, v) for v in x)
    else:
        return f(x)
    return x


def dict_list_map_outplace(f: Callable[[Any], Any], x: Nested) -> Nested:
    """A copy of the nested structure ``x`` with every leaf ``v`` replaced by ``f(v)``."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: Nested, x2: Nested, key: Tuple = ()) -> Nested:
    """Merge ``x2`` into ``x1`` in place (dicts by key, lists by position or int dict keys)."""
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if k not in x1:
                x1[k] = v2
            else:
                x1[k] = merge(x1[k], v2, key=key + (k,))
    elif isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise ValueError(
                f"Cannot merge two lists of different lengths ({len(x1)} and {len(x2)}) at key {key}"
            )
        for i, v2 in enumerate(x2):
            x1[i] = merge(x1[i], v2, key=key + (i,))
    elif isinstance(x1, list) and isinstance(x2, dict):
        for k, v2 in x2.items():
            if not isinstance(k, int) or not 0 <= k < len(x1):
                raise ValueError(f"Dict key {k!r} is not an index of the list at key {key}")
            x1[k] = merge(x1[k], v2, key=key + (k,))
    else:
        raise ValueError(f"Two non-container values at the same key {key}: {type(x1)} and {type(x2)}")
    return x1


def tensors_bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes (so NaNs and -0.0 compare by their bits)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(_as_bytes(a), _as_bytes(b))


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype)  # fresh: stride 1 whatever t's strides are
    flat.copy_(t.detach().reshape(-1))
    return flat.view(torch.uint8)


def diff(x1: Nested, x2: Nested, prefix: Tuple = ()) -> Tuple[list, list, list]:
    """Compare two nested structures: (keys only in x1, keys only in x2, keys with different leaves).

    Tensors are equal when they have the same dtype, shape and bytes (NaNs compare equal).
    """
    only_left, only_right, mismatch = [], [], []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, mism = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += mism
    elif isinstance(x1, list) and isinstance(x2, list):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (v1, v2) in enumerate(zip(x1, x2)):
            left, right, mism = diff(v1, v2, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += mism
    elif isinstance(x1, torch.Tensor) and isinstance(x2, torch.Tensor):
        if not tensors_bitwise_equal(x1, x2):
            mismatch.append((prefix, type(x1), type(x2)))
    else:
        try:
            equal = bool(x1 == x2)
        except Exception:
            equal = False
        if type(x1) is not type(x2) or not equal:
            mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch

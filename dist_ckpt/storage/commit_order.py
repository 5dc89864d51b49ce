"""The order in which a root's checkpoints were saved: the truth for "newest", not step numbers.

A run that resumes from an older checkpoint (``load(step=200)`` after 300 was saved) and saves
250 has made 250 its newest checkpoint, though 300 has the higher number; retention that kept
the highest steps deleted the new run and the next resume took the abandoned 300. So the
manager numbers its saves: ``dist_ckpt_commit_order.json`` in the root maps each checkpoint
directory name to a sequence number, given by the coordinator when the save *starts* (so a
crash between the commit and any later bookkeeping still leaves the checkpoint numbered; a
number whose save never committed names nothing and is ignored). Saves commit in the order
they start (the queue finalizes in order), so sequence order is commit order.

Checkpoints without a number (written by Megatron-LM, or before this file existed) count as
older than every numbered one, by step among themselves.
"""

from __future__ import annotations

import json
from typing import Dict, Iterable, List, Tuple

from ..core import CheckpointingException
from .run_root import RunRoot

__all__ = ["COMMIT_ORDER_FNAME", "read_commit_order", "record_save_start", "newest_first"]

COMMIT_ORDER_FNAME = "dist_ckpt_commit_order.json"


def read_commit_order(root: RunRoot) -> Dict[str, int]:
    """Directory name -> sequence number (empty when the root has no record)."""
    text = root.read_text(COMMIT_ORDER_FNAME)
    if text is None:
        return {}
    where = f"{root}/{COMMIT_ORDER_FNAME}"
    try:
        raw = json.loads(text)
    except ValueError as e:
        raise CheckpointingException(f"{where} is damaged ({e}); delete it to order checkpoints by step "
                                     f"number again") from None
    order = raw.get("order") if isinstance(raw, dict) else None
    if not isinstance(order, dict) or not all(isinstance(v, int) for v in order.values()):
        raise CheckpointingException(f"{where} is not a commit-order record of dist_ckpt; delete it to order "
                                     f"checkpoints by step number again")
    return dict(order)


#: numbers of this many latest saves are kept even while their directory is not there: a save in
#: flight has no directory at the target until it commits (it stages beside it)
_KEEP_RECENT = 100


def record_save_start(root: RunRoot, name: str, existing: Iterable[str]) -> int:
    """Coordinator, before a save of ``root/name`` starts: give it the next sequence number and
    forget the numbers of old directories that no longer exist (``existing``: the root's entries)."""
    order = read_commit_order(root)
    seq = max(order.values(), default=0) + 1
    present = set(existing)
    order = {n: s for n, s in order.items() if n != name and (n in present or s > seq - _KEEP_RECENT)}
    order[name] = seq
    root.write_text(COMMIT_ORDER_FNAME, json.dumps({"order": order}, indent=0, sort_keys=True))
    return seq


def newest_first(names_by_step: Dict[int, str], order: Dict[str, int]) -> List[int]:
    """Steps ordered by commit sequence, newest first; unnumbered ones after all numbered ones,
    by step (higher first)."""

    def key(step: int) -> Tuple[int, int]:
        return (order.get(names_by_step[step], 0), step)

    return sorted(names_by_step, key=key, reverse=True)

"""The multi-process helpers the tests use: ``run_distributed`` on pooled rank processes
(``rank_pool``: spawned once per world size, a fresh process group per call), and how the ranks
word one error."""

import re
from typing import Any, Sequence

from dist_ckpt.runtime.launch import COLLECTIVE_TIMEOUT_S
from rank_pool import run_distributed

__all__ = ["run_distributed", "COLLECTIVE_TIMEOUT_S", "one_error"]

_RANK_PREFIX = re.compile(r"^rank \d+: ")


def one_error(outcomes: Sequence[Any]) -> Any:
    """The one error a failed collective step raised, as every rank reported it: the rank that
    failed its own message, the others the same led by "rank N: " (N the failing rank).
    ``outcomes``: per rank a message, or a tuple (type name, message, ...). Returns the
    unprefixed message (or tuple), after asserting that every rank reported it."""
    def bare(outcome: Any) -> Any:
        if isinstance(outcome, str):
            return _RANK_PREFIX.sub("", outcome, count=1)
        return (outcome[0], _RANK_PREFIX.sub("", outcome[1], count=1), *outcome[2:])

    found = {repr(bare(o)) for o in outcomes}
    assert len(found) == 1, outcomes
    return bare(outcomes[0])

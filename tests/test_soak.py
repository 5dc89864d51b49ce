"""A few trials of each kind of the randomized soak (``tests/soak.py``; ``--trials N`` there
for long runs): kills of a 2-rank job with asynchronous saves (persistent and local tier, and a fresh job's first saves), a
full disk, single-bit flips. Seeded: a failure here is reproduced by its seed and index."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import soak

SEED = 20261128


@pytest.mark.slow
@pytest.mark.parametrize("index,kind", [(i, "flip") for i in range(24)]
                         + [(100 + i, "disk_full") for i in range(4)]
                         + [(200, "kill_persistent"), (201, "kill_persistent"), (300, "kill_local")]
                         + [(400, "kill_local_early"), (401, "kill_local_early")])
def test_soak_trial(index, kind, tmp_path):
    if kind == "disk_full" and os.geteuid() != 0:
        pytest.skip("a full disk is a small tmpfs, and mounting one needs root")
    result = soak.run_trial(index, kind, SEED, Path(tmp_path))
    assert result.problem is None, f"trial {index} ({kind}, seed {SEED}): {result.problem}"

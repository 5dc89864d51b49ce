"""The dist-ckpt command: the demo really saves, reshards and verifies; inspect lists."""

import os
import subprocess
import sys

import pytest

from conftest import FIXTURES


@pytest.mark.slow
def test_demo_saves_with_two_ranks_and_loads_resharded_with_three(tmp_path):
    """README's first command: without --dir, in a temporary directory it removes."""
    out = subprocess.run([sys.executable, "-m", "dist_ckpt.tools.cli", "demo"], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "saved by 2 ranks" in out.stdout and "loaded by 3 ranks" in out.stdout and out.stdout.strip().endswith("OK")
    assert "the temporary directory is removed" in out.stdout
    assert os.listdir(tmp_path) == []


def test_inspect_and_errors(tmp_path, capsys):
    from dist_ckpt.tools.cli import main

    assert main(["inspect", str(FIXTURES / "mcore0.16_torch_dist_w3")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.attn.qkv.weight" in out and "bfloat16" in out and "(2, 72, 8)" in out and "rng/shard_2_3" in out
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err

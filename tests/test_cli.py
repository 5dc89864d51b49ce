"""The dist-ckpt command: the demo really saves, reshards and verifies; inspect lists."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FIXTURES


@pytest.mark.slow
def test_demo_saves_with_two_ranks_and_loads_resharded_with_three(tmp_path):
    """README's first command: without --dir, in a temporary directory it removes. Nothing on
    stderr, also where the deprecated pynvml package is installed (as here; without the test
    suite's own filter): torch's warning about it used to come from every rank (5 times)."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONWARNINGS"}
    out = subprocess.run([str(Path(sys.executable).parent / "dist-ckpt"), "demo"], capture_output=True, text=True,
                         timeout=300, env={**env, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""
    assert "saved by 2 ranks" in out.stdout and "loaded by 3 ranks" in out.stdout and out.stdout.strip().endswith("OK")
    assert "the temporary directory is removed" in out.stdout
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
def test_demo_of_a_size_prints_throughput_beside_raw_file_io(tmp_path):
    """Issue 23.6: --size (16 MiB here; 1GiB in the README) saves, loads in the same layout and
    resharded, checks every byte, and prints dist_ckpt's and raw file I/O's throughput."""
    out = subprocess.run([sys.executable, "-m", "dist_ckpt.tools.cli", "demo", "--size", "16MiB", "--dir",
                          str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("dist_ckpt demo: 0.02 GiB (") and lines[-1] == "OK"
    for phase in ("save, until durable", "load, same layout"):
        row = next(line for line in lines if line.strip().startswith(phase))
        assert row.count("GB/s") == 2, row  # dist_ckpt and raw file I/O
    assert any(line.strip().startswith("load resharded to 3 ranks") for line in lines)
    assert os.listdir(tmp_path) == []  # what the demo wrote is removed


@pytest.mark.slow
def test_manager_demo_is_killed_and_resumes_bit_exactly(tmp_path):
    """Issue 23.6: --manager: async saves, every rank killed during the save of step 6, the new
    job resumes from step 4 bit-exactly and ends equal to an uninterrupted run."""
    out = subprocess.run([sys.executable, "-m", "dist_ckpt.tools.cli", "demo", "--manager"], capture_output=True,
                         text=True, timeout=300, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    assert "step 5: the save of step 4 committed (tracker -> 4)" in out.stdout
    assert "every rank is killed (SIGKILL) while the save of step 6 is in flight" in out.stdout
    assert "resumed from step 4" in out.stdout and "step 4's bit for bit: True" in out.stdout
    assert "never interrupted: True" in out.stdout and out.stdout.strip().endswith("OK")
    assert "committed checkpoints kept: [8, 10]" in out.stdout


def test_inspect_and_errors(tmp_path, capsys):
    from dist_ckpt.tools.cli import main

    assert main(["inspect", str(FIXTURES / "mcore0.16_torch_dist_w3")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.attn.qkv.weight" in out and "bfloat16" in out and "(2, 72, 8)" in out and "rng/shard_2_3" in out
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err

"""The dist-ckpt command: the demo really saves, reshards and verifies; inspect lists; the command
line answers without torch where it can, and says in one line what is wrong."""

import json
import os
import subprocess
import sys
import textwrap
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
    # --dir keeps the checkpoint (not the raw files of the comparison), as its help says
    assert os.listdir(tmp_path) == ["size_demo"] and os.listdir(tmp_path / "size_demo") == ["ckpt"]
    assert f"the checkpoint is kept in {tmp_path / 'size_demo' / 'ckpt'}" in out.stdout
    from dist_ckpt.tools.check import validate_checkpoint

    assert validate_checkpoint(tmp_path / "size_demo" / "ckpt").ok


@pytest.mark.slow
def test_manager_demo_is_killed_and_resumes_bit_exactly(tmp_path):
    """Issue 23.6: --manager: async saves, every rank killed during the save of step 6, the new
    job resumes from step 4 bit-exactly and ends equal to an uninterrupted run."""
    out = subprocess.run([sys.executable, "-m", "dist_ckpt.tools.cli", "demo", "--manager", "--dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "step 5: the save of step 4 committed (tracker -> 4)" in out.stdout
    assert "every rank is killed (SIGKILL) while the save of step 6 is in flight" in out.stdout
    assert "resumed from step 4" in out.stdout and "step 4's bit for bit: True" in out.stdout
    assert "never interrupted: True" in out.stdout and out.stdout.strip().endswith("OK")
    assert "committed checkpoints kept: [8, 10]" in out.stdout
    # --dir keeps the run; `ls` lists what the manager kept
    run = tmp_path / "manager_demo"
    assert f"the run is kept in {run} (dist-ckpt ls {run})" in out.stdout
    listed = subprocess.run([sys.executable, "-m", "dist_ckpt", "ls", str(run)], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0] == f"{run}: 2 checkpoints committed, the tracker names step 10"
    assert lines[2].split()[:2] == ["8", "committed"] and lines[3].split()[:3] == ["10", "committed,", "the"]


def test_inspect_and_errors(tmp_path, capsys):
    from dist_ckpt.tools.cli import main

    assert main(["inspect", str(FIXTURES / "mcore0.16_torch_dist_w3")]) == 0
    out = capsys.readouterr().out
    assert "model.layers.attn.qkv.weight" in out and "bfloat16" in out and "(2, 72, 8)" in out and "rng/shard_2_3" in out
    assert main(["inspect", str(tmp_path)]) == 1
    assert "no committed checkpoint" in capsys.readouterr().err


# -- a command line that answers at once, and says exactly what is wrong ---------------------------


def test_help_version_and_a_mistyped_command_answer_without_importing_torch(tmp_path):
    """torch takes seconds to import (25 s and more on a loaded machine): the console script's
    entry point parses first, and only a command that runs imports dist_ckpt and torch."""
    probe = textwrap.dedent("""
        import json, sys
        import dist_ckpt_cli
        codes = []
        for argv in (["--help"], ["--version"], ["bogus"], ["convert", "--help"], ["convert", "a"]):
            try:
                dist_ckpt_cli.main(argv)
            except SystemExit as e:
                codes.append(e.code)
        print(json.dumps({"codes": codes, "imported": sorted(m for m in ("torch", "dist_ckpt", "numpy")
                                                            if m in sys.modules)}), file=sys.stderr)
    """)
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    result = json.loads(out.stderr.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 2, 0, 2], "imported": []}, out.stderr
    assert "usage: dist-ckpt" in out.stdout and "dist-ckpt ls" in out.stdout
    import dist_ckpt

    assert f"dist-ckpt {dist_ckpt.__version__}" in out.stdout


def test_validate_of_a_path_that_does_not_exist_is_one_line(tmp_path, capsys):
    from dist_ckpt.tools.cli import main

    assert main(["validate", str(tmp_path / "nope")]) == 1
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == f"dist-ckpt: error: {tmp_path / 'nope'} does not exist\n"


def test_convert_to_an_unknown_backend_lists_the_save_backends(tmp_path, capsys):
    from dist_ckpt.tools.cli import main

    assert main(["convert", str(FIXTURES / "mcore0.16_torch_dist_w3"), str(tmp_path / "out"), "--backend", "zar"]) == 2
    err = capsys.readouterr().err
    assert err == ("dist-ckpt convert: error: argument --backend: invalid choice: 'zar' (choose from 'torch_dist', "
                   "'zarr') (see dist-ckpt convert --help)\n")
    assert not (tmp_path / "out").exists()


def test_strategies_table_has_a_header_over_aligned_columns(capsys):
    from dist_ckpt.tools.cli import main

    assert main(["strategies"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split() == ["ACTION", "BACKEND", "VERSION", "SOURCE", "LIBRARY"]
    for column in ("BACKEND", "VERSION", "SOURCE", "LIBRARY"):
        start = lines[0].index(column)
        assert all(line[start - 1] == " " and line[start] != " " for line in lines[1:]), (column, lines)
    assert any(line.split()[:3] == ["save_sharded", "torch_dist", "v1"] for line in lines[1:])


def test_validate_and_inspect_count_in_words(tmp_path, capsys):
    """One tensor is "1 tensor", one problem "1 problem"."""
    import torch

    import dist_ckpt
    from dist_ckpt.tools.cli import main

    dist_ckpt.save({"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", torch.ones(3))}, tmp_path / "one")
    assert main(["validate", str(tmp_path / "one")]) == 0
    out = capsys.readouterr().out
    assert "structure and coverage of 1 tensor checked" in out and "0 problems)" in out
    assert main(["inspect", str(tmp_path / "one")]) == 0
    assert "total: 1 tensor, 12 B, 0 objects" in capsys.readouterr().out
    data = next(p for p in (tmp_path / "one").iterdir() if p.suffix == ".distcp")
    raw = bytearray(data.read_bytes())
    raw[0] ^= 1
    data.write_bytes(bytes(raw))
    assert main(["validate", str(tmp_path / "one")]) == 1
    assert "; 1 problem)" in capsys.readouterr().out


def test_diff_shows_both_values_of_common_state_and_can_leave_it_out(tmp_path, capsys):
    import torch

    import dist_ckpt
    from dist_ckpt.tools.cli import main

    for name, step in (("a", 100), ("b", 200)):
        dist_ckpt.save({"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", torch.ones(3)), "iteration": step,
                        "args": {"lr": 0.1}}, tmp_path / name)
    assert main(["diff", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"common state differs: iteration: 100 in {tmp_path / 'a'}, 200 in {tmp_path / 'b'}"
    assert out[-1].startswith("DIFFERENT: 1 tensor bit-exact, 0 differ")
    assert main(["diff", "--tensors-only", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"same: 1 tensor bit-exact, 0 differ, 0 only in {tmp_path / 'a'}, 0 only in {tmp_path / 'b'}; "
                   f"common state not compared (--tensors-only)"]

"""Every ```python snippet in README.md and in the documentation (docs/**/*.md) runs as written
(in a fresh interpreter, in a working directory of its own), twice in a row; every script shown
as a file (```python title="NAME.py"```) runs with the commands of the ```bash block after it,
``torchrun`` included (real ranks on a gloo group).

The S3 snippet talks to a real local S3 server (moto's server mode) holding the bucket the
documentation names; the AWS_* variables the snippets inherit point at it.
"""

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from s3_server import moto_server

pytestmark = pytest.mark.slow

ROOT = Path(__file__).parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _snippets() -> list:
    """(page, snippet) of every python block, each distinct snippet once."""
    seen, found = set(), []
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), flags=re.S):
            if block not in seen:
                seen.add(block)
                found.append((page.relative_to(ROOT), block))
    return found


def test_every_example_runs(tmp_path):
    snippets = _snippets()
    assert {str(page) for page, _ in snippets} >= {"README.md", "docs/getting-started.md", "docs/concepts.md"}
    assert any("s3://dist-ckpt-readme/" in b for _, b in snippets)
    shutil.rmtree("/tmp/dist_ckpt_readme", ignore_errors=True)
    with moto_server({"DIST_CKPT_CACHE": str(tmp_path / "cache"), "DIST_CKPT_SCRATCH": str(tmp_path / "scratch")}):
        import boto3

        boto3.client("s3").create_bucket(Bucket="dist-ckpt-readme")
        elsewhere = tmp_path / "cwd"  # not the checkout: an example must not depend on where it runs
        elsewhere.mkdir()
        try:
            for page, block in snippets:
                # a fresh interpreter per snippet, which runs it twice: what the first run left on
                # disk (checkpoints, the S3 objects) must not break a second run
                twice = f"block = {block!r}\nfor _ in range(2):\n    exec(compile(block, {str(page)!r}, 'exec'), {{'__name__': '__main__'}})\n"
                out = subprocess.run([sys.executable, "-c", twice], capture_output=True, text=True, timeout=240,
                                     cwd=elsewhere)
                assert out.returncode == 0, f"snippet of {page} failed:\n{block}\n{out.stderr}"
        finally:
            shutil.rmtree("/tmp/dist_ckpt_readme", ignore_errors=True)


# A command of a ```bash block after a script, as the test runs it (the console scripts through
# this interpreter, so that the checkout's environment is the one used).
_COMMANDS = {"torchrun": [sys.executable, "-m", "torch.distributed.run"], "dist-ckpt": [sys.executable, "-m", "dist_ckpt"]}


def _scripts() -> list:
    """(page, file name, script, [command lines]) of every ```python title="..."``` block."""
    found, seen = [], set()
    pattern = r'```python title="([\w.-]+)"\n(.*?)```\s*```bash\n(.*?)```'
    for page in PAGES:
        for name, script, commands in re.findall(pattern, page.read_text(), flags=re.S):
            if (name, script) not in seen:
                seen.add((name, script))
                lines = [line.split("  #")[0].strip() for line in commands.splitlines()]
                found.append((page.relative_to(ROOT), name, script, [line for line in lines if line]))
    return found


def test_every_script_runs_with_its_commands_under_torchrun(tmp_path):
    """README's and Getting started's torchrun example: 2 ranks save, 3 and then 4 resume the run
    in their own splits (the script asserts every value), and ``dist-ckpt ls`` lists it; the
    manager guide's loop is preempted, saves and stops, then resumes and keeps its best."""
    scripts = _scripts()
    assert {(str(page), name) for page, name, _, _ in scripts} >= {("README.md", "train_resharding.py"),
                                                                   ("docs/guides/manager.md", "train_with_policies.py")}
    assert any(any(c.startswith("torchrun ") for c in commands) for _, _, _, commands in scripts)
    for page, name, script, commands in scripts:
        work = tmp_path / name.replace(".", "_")
        work.mkdir()
        (work / name).write_text(script)
        outputs = []
        for line in commands:
            words = [w.replace("/tmp/dist_ckpt_run", str(work / "run")) for w in shlex.split(line)]
            argv = _COMMANDS.get(words[0], [words[0]]) + words[1:]
            out = subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=work)
            assert out.returncode == 0, f"{page}: {line}\n{out.stdout}\n{out.stderr}"
            outputs.append(out.stdout)
        if name == "train_resharding.py":
            assert outputs[:3] == ["2 ranks: a new run, trained and saved steps 1-5\n",
                                   "3 ranks: resumed from step 5, trained and saved steps 6-10\n",
                                   "4 ranks: resumed from step 10, trained and saved steps 11-15\n"], outputs
            listed = outputs[3].splitlines()
            assert listed[0].endswith(": 2 checkpoints committed, the tracker names step 15"), listed
            assert [row.split()[:2] for row in listed[2:]] == [["14", "committed"], ["15", "committed,"]], listed
        if name == "train_with_policies.py":  # preempted at step 50 (a SIGTERM to rank 1), then resumed to 100
            assert outputs[:2] == ["2 ranks: steps 1-50, stopped: preemption (a signal on another rank)\n",
                                   "2 ranks: steps 51-100\n"], outputs
            listed = outputs[2].splitlines()
            assert [row.split()[:2] for row in listed[2:]] == [["80", "committed"], ["100", "committed,"]], listed
            assert listed[2].endswith("val_loss=1.25") and listed[3].endswith("val_loss=1"), listed

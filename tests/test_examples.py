"""Every ```python snippet in README.md and in the documentation (docs/**/*.md) runs as written
(in a fresh interpreter), twice in a row.

The S3 snippet talks to a real local S3 server (moto's server mode) holding the bucket the
documentation names; the AWS_* variables the snippets inherit point at it.
"""

import re
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
        try:
            for page, block in snippets:
                # a fresh interpreter per snippet, which runs it twice: what the first run left on
                # disk (checkpoints, the S3 objects) must not break a second run
                twice = f"block = {block!r}\nfor _ in range(2):\n    exec(compile(block, {str(page)!r}, 'exec'), {{'__name__': '__main__'}})\n"
                out = subprocess.run([sys.executable, "-c", twice], capture_output=True, text=True, timeout=240,
                                     cwd=ROOT)
                assert out.returncode == 0, f"snippet of {page} failed:\n{block}\n{out.stderr}"
        finally:
            shutil.rmtree("/tmp/dist_ckpt_readme", ignore_errors=True)

"""Every ```python snippet in README.md runs as written (in a fresh interpreter), twice in a row.

The S3 snippet talks to a real local S3 server (moto's server mode) holding the bucket the
README names; the AWS_* variables the snippets inherit point at it.
"""

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from s3_server import moto_server

README = Path(__file__).parent.parent / "README.md"

pytestmark = pytest.mark.slow


def test_readme_snippets_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 8
    assert any("s3://dist-ckpt-readme/" in b for b in blocks)
    shutil.rmtree("/tmp/dist_ckpt_readme", ignore_errors=True)
    with moto_server({"DIST_CKPT_CACHE": str(tmp_path / "cache"), "DIST_CKPT_SCRATCH": str(tmp_path / "scratch")}):
        import boto3

        boto3.client("s3").create_bucket(Bucket="dist-ckpt-readme")
        try:
            for block in blocks:
                # a fresh interpreter per snippet, which runs it twice: what the first run left on
                # disk (checkpoints, the S3 objects) must not break a second run
                twice = f"block = {block!r}\nfor _ in range(2):\n    exec(compile(block, 'README', 'exec'), {{'__name__': '__main__'}})\n"
                out = subprocess.run([sys.executable, "-c", twice], capture_output=True, text=True, timeout=240,
                                     cwd=README.parent)
                assert out.returncode == 0, f"snippet failed:\n{block}\n{out.stderr}"
        finally:
            shutil.rmtree("/tmp/dist_ckpt_readme", ignore_errors=True)

"""Every ```python snippet in README.md runs as written (in a fresh interpreter)."""

import re
import shutil
import subprocess
import sys
from pathlib import Path

README = Path(__file__).parent.parent / "README.md"


def test_readme_snippets_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert len(blocks) >= 3
    shutil.rmtree("/tmp/dist_ckpt_readme", ignore_errors=True)
    try:
        for block in blocks:
            out = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True, timeout=120,
                                 cwd=README.parent)
            assert out.returncode == 0, f"snippet failed:\n{block}\n{out.stderr}"
    finally:
        shutil.rmtree("/tmp/dist_ckpt_readme", ignore_errors=True)

import os
import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))

# The test extra installs nvidia-resiliency-ext, which requires the deprecated ``pynvml``
# package; with it installed, ``import torch`` prints torch's FutureWarning about it to stderr in
# every process. The CLI tests check that dist-ckpt's own stderr is one clean line, so the
# command processes they start (which inherit this environment) leave out that one warning.
_PYNVML_WARNING = "ignore:The pynvml package is deprecated:FutureWarning"
os.environ["PYTHONWARNINGS"] = ",".join(filter(None, [os.environ.get("PYTHONWARNINGS"), _PYNVML_WARNING]))

FIXTURES = TESTS_DIR / "fixtures" / "megatron"


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES

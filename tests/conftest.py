import os
import signal
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

# Tests send Ctrl-C (SIGINT) to the commands they start, as a terminal does. A shell without job
# control starts background jobs with SIGINT ignored (POSIX), and an ignored signal stays ignored
# across fork and exec: pytest started that way (a CI script run in the background) would start
# commands that ignore every Ctrl-C, and the tests would measure the shell, not dist-ckpt (one
# CI run failed so: the demo ran to its end after the signal). Python's own handler is what a
# terminal gives pytest, and a handler (unlike SIG_IGN) is reset to the default in a new program.
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

FIXTURES = TESTS_DIR / "fixtures" / "megatron"


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES

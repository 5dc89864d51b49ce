"""The ``dist-ckpt`` console script's entry point, outside the package on purpose.

Importing ``dist_ckpt`` imports torch, which takes seconds. A KeyboardInterrupt raised in the
middle of that import either prints a traceback from deep inside torch or, worse, is swallowed
by an import hook and leaves torch half-initialised (the command then fails later with an
unrelated error). So during the import a Ctrl-C is only noted; once the import is complete,
the command ends with "interrupted" and exit code 130 instead of starting. A command started
with Ctrl-C ignored (``nohup``, a shell's background job) keeps ignoring it, as it would without
this.
"""

import os
import signal
import sys
import warnings
from typing import List

__all__ = ["main"]

_PYNVML_WARNING = "The pynvml package is deprecated"


def main() -> int:
    # torch prints a FutureWarning on import wherever the deprecated ``pynvml`` package is
    # installed (as on many GPU machines): not about this command, so the command leaves it out,
    # here and in the rank processes it starts (a new Python reads PYTHONWARNINGS; the demo's five
    # ranks printed it five times)
    warnings.filterwarnings("ignore", message=_PYNVML_WARNING, category=FutureWarning)
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), f"ignore:{_PYNVML_WARNING}:FutureWarning"]))
    received: List[int] = []
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # started so (nohup, a background job)
    previous = None if ignored else signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        from dist_ckpt.tools.cli import main as run_command
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if received:
        print("dist-ckpt: interrupted", file=sys.stderr)
        return 130
    return run_command()


if __name__ == "__main__":
    sys.exit(main())

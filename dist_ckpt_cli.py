"""The ``dist-ckpt`` console script's entry point, outside the package on purpose.

Importing ``dist_ckpt`` imports torch, which takes seconds; a Ctrl-C in that window would
otherwise end in a KeyboardInterrupt traceback from deep inside torch's import, before
``dist_ckpt.cli.main`` (which handles interrupts) exists. Here the import itself is guarded.
"""

import sys

__all__ = ["main"]


def main() -> int:
    try:
        from dist_ckpt.cli import main as run_command
    except KeyboardInterrupt:
        print("dist-ckpt: interrupted", file=sys.stderr)
        return 130
    return run_command()


if __name__ == "__main__":
    sys.exit(main())

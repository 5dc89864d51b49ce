"""The ``dist-ckpt`` console script's entry point, and its command line, outside the package on
purpose: importing ``dist_ckpt`` imports torch, which takes seconds (25 s and more on a loaded
machine), and none of ``--help``, ``--version`` or a mistyped command needs it.

So the arguments are parsed here, with nothing but the standard library; only a command that
runs imports the package. A KeyboardInterrupt raised in the middle of that import either prints
a traceback from deep inside torch or, worse, is swallowed by an import hook and leaves torch
half-initialised (the command then fails later with an unrelated error). So during the import a
Ctrl-C is only noted; once the import is complete, the command ends with "interrupted" and exit
code 130 instead of starting. A command started with Ctrl-C ignored (``nohup``, a shell's
background job) keeps ignoring it, as it would without this.
"""

import argparse
import importlib.util
import os
import runpy
import signal
import sys
import warnings
from pathlib import Path
from typing import List, NoReturn, Optional

__all__ = ["main", "build_parser"]

_PYNVML_WARNING = "The pynvml package is deprecated"


def _version() -> str:
    """dist_ckpt's version, read from ``dist_ckpt/_version.py`` without importing the package."""
    spec = importlib.util.find_spec("dist_ckpt")  # finds the package; runs none of it
    if spec is None or spec.origin is None:
        return "unknown"
    return str(runpy.run_path(str(Path(spec.origin).with_name("_version.py")))["__version__"])


_EXAMPLES = {
    "demo": "dist-ckpt demo --dir /tmp/dist_ckpt_demo",
    "inspect": "dist-ckpt inspect ckpt/iter_0000100 --json",
    "diff": "dist-ckpt diff ckpt/iter_0000100 hf_model",
    "convert": "dist-ckpt convert ckpt/iter_0000100 ckpt_zarr/iter_0000100 --backend zarr",
    "export": "dist-ckpt export ckpt/iter_0000100 hf_model --max-shard-size 2GB --dtype bf16",
    "validate": "dist-ckpt validate ckpt/iter_0000100",
    "clean": "dist-ckpt clean ckpt",
    "strategies": "dist-ckpt strategies",
    "ls": "dist-ckpt ls ckpt --local-dir /dev/shm/ckpt",
}


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (what is wrong and where to look), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The ``dist-ckpt`` parser; ``--help`` ends with every command's usage and an example."""
    parser = _Parser(prog="dist-ckpt", description="Distributed checkpoints, Megatron-Core compatible.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dist-ckpt {_version()}")
    parser.add_argument("-v", "--verbose", action="store_true", help="print a per-phase timing table to stderr")
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help='fsspec options for URL sources and targets, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\' '
                             '(S3 also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)')
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=f"example: {_EXAMPLES[name]}")

    demo = command("demo", "2 gloo ranks save a GPT-like model, 3 ranks load it resharded and verify every byte")
    demo.add_argument("--dir", default=None, help="where to write; what is saved is kept there: DIR/ckpt "
                                                  "(--size: DIR/size_demo/ckpt, --manager: the run DIR/manager_demo; "
                                                  "default: a temporary directory, removed after)")
    demo.add_argument("--save-ranks", type=_positive_int, default=2, metavar="N", help="ranks that save (default 2)")
    demo.add_argument("--load-ranks", type=_positive_int, default=3, metavar="N", help="ranks that load (default 3)")
    demo.add_argument("--size", default=None, metavar="SIZE",
                      help="save and load SIZE (e.g. 1GiB) of fp32 matrices instead, beside raw file I/O of the "
                           "same bytes (throughput of both)")
    demo.add_argument("--manager", action="store_true",
                      help="a short training loop on CheckpointManager: async saves, all ranks killed during one, "
                           "a bit-exact resume")
    ls = command("ls", "every checkpoint of a run: step, state (committed, incomplete, leftover, the tracker's), "
                       "size, files, writer, age")
    ls.add_argument("run", metavar="RUN", help="a run's directory of iter_XXXXXXX checkpoints, or its URL")
    ls.add_argument("--local-dir", default=None, metavar="DIR",
                    help="also the steps of the local tier in DIR (CheckpointManager's local_dir)")
    ls.add_argument("--json", action="store_true", help="one JSON document instead of text")
    inspect = command("inspect", "per tensor: dtype, shape, bytes, chunks, writers; totals per prefix; backends")
    inspect.add_argument("directory", metavar="CKPT", help="a checkpoint directory or URL, any format")
    inspect.add_argument("--json", action="store_true", help="one JSON document instead of text")
    diff = command("diff", "compare two checkpoints of any format, tensor by tensor; exit code 1 when they differ")
    diff.add_argument("a", metavar="A", help="a checkpoint directory or URL, any format")
    diff.add_argument("b", metavar="B", help="another one")
    diff.add_argument("--tensors-only", action="store_true",
                      help="compare the tensors only, not the common state (an HF export has none)")
    convert = command("convert", "rewrite a checkpoint in another backend (one tensor in memory at a time)")
    convert.add_argument("src", metavar="SRC", help="a checkpoint directory or URL, any format")
    convert.add_argument("dst", metavar="DST", help="the new checkpoint's directory or URL")
    convert.add_argument("--backend", required=True,
                         help="target backend: a registered save backend (torch_dist, zarr; `dist-ckpt strategies`)")
    convert.add_argument("--version", type=int, default=1, help="target backend version (default 1)")
    convert.add_argument("--overwrite", action="store_true",
                         help="replace a checkpoint at DST once the new one is complete (other files there are kept)")
    export = command("export", "write any checkpoint as Hugging Face safetensors shards + index, streaming")
    export.add_argument("src", metavar="SRC", help="a checkpoint directory or URL, any format")
    export.add_argument("dst", metavar="DST", help="a directory (new, or a model folder without weights) or URL")
    export.add_argument("--format", choices=["safetensors"], default="safetensors")
    export.add_argument("--max-shard-size", default="5GB", help="bytes per file: 5GB (default), 500MB, 2GiB")
    export.add_argument("--include", default=None, metavar="REGEX", help="only keys this regular expression finds")
    export.add_argument("--dtype", default=None, help="cast floating-point tensors: bf16, fp16, fp32")
    export.add_argument("--rename", default=None, metavar="NAME|MODULE:FUNCTION",
                        help="a key renamer: a registered name (dist_ckpt.key_renamers entry points), or "
                             "module:function imported from the current directory or PYTHONPATH")
    export.add_argument("--rename-map", default=None, metavar="FILE.json",
                        help='key renames as JSON: {"names": {old: new}, "rules": [[regex, replacement]]}')
    export.add_argument("--config", default=None, metavar="FILE", help="a config.json to copy into DST")
    export.add_argument("--overwrite", action="store_true",
                        help="replace the weights DST holds already (its other files, e.g. tokenizer, stay)")
    command("strategies", "list registered strategies and whether their libraries are installed")
    validate = command("validate", "check a checkpoint: structure, coverage, checksums; exit code 1 when invalid, "
                                   "2 when its format is newer than this torch or dist_ckpt reads")
    validate.add_argument("directory", metavar="CKPT", help="a checkpoint directory or URL")
    clean = command("clean", "remove what interrupted saves left (staging directories), restore a checkpoint an "
                             "interrupted overwrite moved aside; nothing else is touched")
    clean.add_argument("path", metavar="PATH", help="a checkpoint directory, or a directory of checkpoints")
    lines = ["commands, their arguments and an example:"]
    for name, subparser in sub.choices.items():
        usage = " ".join(w for w in subparser.format_usage().split()[1:] if w != "[-h]")
        lines += [f"  {usage}", f"      e.g. {_EXAMPLES[name]}"]
    parser.epilog = "\n".join(lines)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    """Parse the command line, then import dist_ckpt (guarded against Ctrl-C) and run it."""
    # torch prints a FutureWarning on import wherever the deprecated ``pynvml`` package is
    # installed (as on many GPU machines): not about this command, so the command leaves it out,
    # here and in the rank processes it starts (a new Python reads PYTHONWARNINGS; the demo's five
    # ranks printed it five times)
    warnings.filterwarnings("ignore", message=_PYNVML_WARNING, category=FutureWarning)
    os.environ["PYTHONWARNINGS"] = ",".join(
        filter(None, [os.environ.get("PYTHONWARNINGS"), f"ignore:{_PYNVML_WARNING}:FutureWarning"]))
    args = build_parser().parse_args(argv)  # --help, --version and usage errors end here
    received: List[int] = []
    ignored = signal.getsignal(signal.SIGINT) is signal.SIG_IGN  # started so (nohup, a background job)
    previous = None if ignored else signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        from dist_ckpt.tools.cli import run as run_command
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
    if received:
        print("dist-ckpt: interrupted", file=sys.stderr)
        return 130
    return run_command(args)


if __name__ == "__main__":
    sys.exit(main())

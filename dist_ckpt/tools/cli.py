"""The ``dist-ckpt`` command: ``demo``, ``inspect``, ``diff``, ``convert``, ``export``, ``validate``, ``clean``, ``strategies``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any, List, NoReturn, Optional

__all__ = ["main", "build_parser"]


def _inspect(source: str, storage_options: Optional[dict], as_json: bool) -> None:
    import json

    from .inspection import format_summary, summarize_checkpoint

    summary = summarize_checkpoint(source, storage_options)
    print(json.dumps(summary.to_json(), indent=2) if as_json else format_summary(summary))


_EXAMPLES = {
    "demo": "dist-ckpt demo --dir /tmp/dist_ckpt_demo",
    "inspect": "dist-ckpt inspect ckpt/iter_0000100 --json",
    "diff": "dist-ckpt diff ckpt/iter_0000100 hf_model",
    "convert": "dist-ckpt convert ckpt/iter_0000100 ckpt_zarr/iter_0000100 --backend zarr",
    "export": "dist-ckpt export ckpt/iter_0000100 hf_model --max-shard-size 2GB --dtype bf16",
    "validate": "dist-ckpt validate ckpt/iter_0000100",
    "clean": "dist-ckpt clean ckpt",
    "strategies": "dist-ckpt strategies",
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
    from .. import __version__

    parser = _Parser(prog="dist-ckpt", description="Distributed checkpoints, Megatron-Core compatible.",
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"dist-ckpt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="print a per-phase timing table to stderr")
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help='fsspec options for URL sources and targets, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\' '
                             '(S3 also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)')
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, epilog=f"example: {_EXAMPLES[name]}")

    demo = command("demo", "2 gloo ranks save a GPT-like model, 3 ranks load it resharded and verify every byte")
    demo.add_argument("--dir", default=None, help="where to write; the checkpoint is kept there as DIR/ckpt "
                                                  "(default: a temporary directory, removed after)")
    demo.add_argument("--save-ranks", type=_positive_int, default=2, metavar="N", help="ranks that save (default 2)")
    demo.add_argument("--load-ranks", type=_positive_int, default=3, metavar="N", help="ranks that load (default 3)")
    demo.add_argument("--size", default=None, metavar="SIZE",
                      help="save and load SIZE (e.g. 1GiB) of fp32 matrices instead, beside raw file I/O of the "
                           "same bytes (throughput of both)")
    demo.add_argument("--manager", action="store_true",
                      help="a short training loop on CheckpointManager: async saves, all ranks killed during one, "
                           "a bit-exact resume")
    inspect = command("inspect", "per tensor: dtype, shape, bytes, chunks, writers; totals per prefix; backends")
    inspect.add_argument("directory", metavar="CKPT", help="a checkpoint directory or URL, any format")
    inspect.add_argument("--json", action="store_true", help="one JSON document instead of text")
    diff = command("diff", "compare two checkpoints of any format, tensor by tensor; exit code 1 when they differ")
    diff.add_argument("a", metavar="A", help="a checkpoint directory or URL, any format")
    diff.add_argument("b", metavar="B", help="another one")
    convert = command("convert", "rewrite a checkpoint in another backend (one tensor in memory at a time)")
    convert.add_argument("src", metavar="SRC", help="a checkpoint directory or URL, any format")
    convert.add_argument("dst", metavar="DST", help="the new checkpoint's directory or URL")
    convert.add_argument("--backend", required=True, help="target backend, e.g. torch_dist or zarr")
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


class _Terminated(BaseException):
    """SIGTERM, turned into an exception so that cleanup (``finally``) runs. A BaseException on
    purpose, like KeyboardInterrupt: an ``except Exception`` in a strategy, a plugin or a
    cleanup path must not swallow a termination and carry on; ``main`` catches it (exit 143)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; returns the exit code. Errors are one line on stderr, never a traceback:
    1 for a failure, 2 for bad options, 130 after Ctrl-C, 143 after SIGTERM."""
    args = build_parser().parse_args(argv)
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if in_main_thread else None
    try:
        return _main(args)
    except KeyboardInterrupt:
        print("dist-ckpt: interrupted", file=sys.stderr)
        return 130
    except _Terminated:
        print("dist-ckpt: terminated", file=sys.stderr)
        return 143
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(args: argparse.Namespace) -> int:
    from ..core import CheckpointingException
    from ..runtime.timing import format_table, recording

    try:
        with recording() as times:
            code = _run(args)
        if args.verbose:
            sys.stdout.flush()
            print(format_table(times), file=sys.stderr)
        return code
    except CheckpointingException as e:
        print(f"dist-ckpt: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except ValueError as e:  # bad option values (sizes, dtypes, patterns)
        print(f"dist-ckpt: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `dist-ckpt inspect DIR | head`: the reader left, nothing more to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except OSError as e:  # unreadable source, unwritable target, full disk: the system's words, one line
        print(f"dist-ckpt: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except Exception as e:  # a bug of ours or of a plugin: still one line, the traceback on request
        if os.environ.get("DIST_CKPT_TRACEBACK"):
            raise
        print(f"dist-ckpt: error: {_one_line(e)} (unexpected; DIST_CKPT_TRACEBACK=1 shows the traceback)",
              file=sys.stderr)
        return 1


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if isinstance(e, (OSError, ValueError)) or type(e).__module__.startswith("dist_ckpt") \
        else f"{type(e).__name__}: {text}"


def _run(args: argparse.Namespace) -> int:
    """One command; errors are left to ``main``, which prints them as one line."""
    storage_options = _parse_storage_options(args.storage_options)
    if args.command == "demo":
        if args.size is not None and args.manager:
            raise ValueError("--size and --manager are two demos: give one of them")
        if args.size is not None:
            from .demo_size import run_size_demo
            from .export import parse_size

            run_size_demo(parse_size(args.size), args.dir, args.save_ranks, args.load_ranks)
        elif args.manager:
            from .demo_manager import run_manager_demo

            run_manager_demo(args.dir)
        else:
            from .demo import run_demo

            run_demo(args.dir, args.save_ranks, args.load_ranks)
    elif args.command == "inspect":
        _inspect(args.directory, storage_options, args.json)
    elif args.command == "diff":
        from .diff import diff_checkpoints, format_report

        differences = diff_checkpoints(args.a, args.b, storage_options=storage_options,
                                       progress=_progress_bar("comparing"))
        print(format_report(args.a, args.b, differences))
        return 0 if differences.same else 1
    elif args.command == "convert":
        from .convert import convert_checkpoint

        convert_checkpoint(args.src, args.dst, args.backend, args.version, overwrite=args.overwrite,
                           storage_options=storage_options, progress=_progress_bar("converting"))
        print(f"converted {args.src} -> {args.dst} ({args.backend} v{args.version})")
    elif args.command == "export":
        from .export import export_safetensors, key_renamer_from_map

        if args.rename and args.rename_map:
            raise ValueError("--rename and --rename-map: give one of them")
        rename = key_renamer_from_map(args.rename_map) if args.rename_map else args.rename
        result = export_safetensors(args.src, args.dst, args.max_shard_size, args.include, args.dtype, rename,
                                    progress=_progress_bar("exporting"), storage_options=storage_options,
                                    overwrite=args.overwrite, config=args.config)
        print(f"exported {result.tensors} tensors ({result.total_size} bytes) of {args.src} -> {args.dst} "
              f"in {len(result.files)} safetensors files")
    elif args.command == "validate":
        from .check import validate_checkpoint

        report = validate_checkpoint(args.directory, storage_options=storage_options,
                                     progress=_progress_bar("verifying", unit="file"))
        for warning in report.warnings:
            print(f"warning: {warning}")
        for problem in report.problems:
            print(f"PROBLEM: {problem}")
        if report.unsupported is not None:
            print(f"UNSUPPORTED: {report.unsupported}")
        print(report.summary(args.directory))
        return 0 if report.ok else 1 if report.problems else 2
    elif args.command == "clean":
        from pathlib import Path

        from ..storage.clean import clean as clean_leftovers
        from ..storage.object_store import clean_url, is_url

        removed = (clean_url(args.path, storage_options) if is_url(args.path)
                   else clean_leftovers(Path(args.path)))
        for path in removed:
            print(f"removed {path}")
        print(f"{len(removed)} leftover(s) removed")
    elif args.command == "strategies":
        from ..strategies.base import list_strategies

        for row in list_strategies():
            print(row)
    return 0


def _parse_storage_options(text: Optional[str]) -> Optional[dict]:
    if text is None:
        return None
    import json

    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--storage-options must be a JSON object ({e})") from None
    if not isinstance(value, dict):
        raise ValueError("--storage-options must be a JSON object")
    return value


def _progress_bar(what: str, unit: str = "tensor") -> Any:
    """tqdm over an iterable when stderr is a terminal and tqdm is installed; else None."""
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return lambda iterable: tqdm(iterable, desc=what, unit=unit, file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())

"""The ``dist-ckpt`` command: ``demo``, ``inspect``, ``diff``, ``convert``, ``export``, ``validate``, ``clean``, ``strategies``."""

from __future__ import annotations

import argparse
import sys
from typing import Any, List, Optional

__all__ = ["main"]


def _inspect(source: str, storage_options: Optional[dict], as_json: bool) -> None:
    import json

    from .inspection import format_summary, summarize_checkpoint

    summary = summarize_checkpoint(source, storage_options)
    print(json.dumps(summary.to_json(), indent=2) if as_json else format_summary(summary))


def main(argv: Optional[List[str]] = None) -> int:
    from . import __version__

    parser = argparse.ArgumentParser(prog="dist-ckpt", description="Distributed checkpoints, Megatron-Core compatible.")
    parser.add_argument("--version", action="version", version=f"dist-ckpt {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="print a per-phase timing table to stderr")
    parser.add_argument("--storage-options", default=None, metavar="JSON",
                        help='fsspec options for URL sources and targets, e.g. \'{"endpoint_url": "http://127.0.0.1:9000"}\' '
                             '(S3 also reads AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...)')
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="2 gloo ranks save a GPT-like model, 3 ranks load it resharded and verify")
    demo.add_argument("--dir", default=None, help="where to write (default: a temporary directory, removed after)")
    demo.add_argument("--save-ranks", type=int, default=2)
    demo.add_argument("--load-ranks", type=int, default=3)
    inspect = sub.add_parser("inspect", help="per tensor: dtype, shape, bytes, chunks, writers; totals per prefix; "
                                             "backends (e.g. dist-ckpt inspect ckpt/iter_0000100 --json)")
    inspect.add_argument("directory", help="a checkpoint directory or URL, any format")
    inspect.add_argument("--json", action="store_true", help="one JSON document instead of text")
    diff = sub.add_parser("diff", help="compare two checkpoints of any format, tensor by tensor; exit 1 when they "
                                       "differ (e.g. dist-ckpt diff ckpt/iter_0000100 hf_model)")
    diff.add_argument("a")
    diff.add_argument("b")
    convert = sub.add_parser("convert", help="rewrite a checkpoint in another backend (one tensor in memory at a time)")
    convert.add_argument("src")
    convert.add_argument("dst")
    convert.add_argument("--backend", required=True, help="target backend, e.g. torch_dist or zarr")
    convert.add_argument("--version", type=int, default=1)
    export = sub.add_parser("export", help="write any checkpoint as Hugging Face safetensors shards + index, "
                                           "streaming (e.g. dist-ckpt export ckpt/iter_0000100 hf_model)")
    export.add_argument("src")
    export.add_argument("dst", help="a new (or empty) directory")
    export.add_argument("--format", choices=["safetensors"], default="safetensors")
    export.add_argument("--max-shard-size", default="5GB", help="bytes per file: 5GB (default), 500MB, 2GiB")
    export.add_argument("--include", default=None, help="only keys this regular expression finds")
    export.add_argument("--dtype", default=None, help="cast floating-point tensors: bf16, fp16, fp32")
    export.add_argument("--rename", default=None, help="a registered key renamer (dist_ckpt.key_renamers entry points)")
    sub.add_parser("strategies", help="list registered strategies and whether their libraries are installed")
    validate = sub.add_parser("validate", help="check a checkpoint: structure, coverage, checksums")
    validate.add_argument("directory")
    clean = sub.add_parser("clean", help="remove what interrupted saves left (staging directories), restore "
                                         "a checkpoint an interrupted overwrite moved aside")
    clean.add_argument("path", help="a checkpoint directory, or a directory of checkpoints")
    args = parser.parse_args(argv)
    from .core import CheckpointingException
    from .timing import format_table, recording

    try:
        with recording() as times:
            code = _run(args)
        if args.verbose:
            sys.stdout.flush()
            print(format_table(times), file=sys.stderr)
        return code
    except CheckpointingException as e:
        print(f"dist-ckpt: error: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # bad option values (sizes, dtypes, patterns)
        print(f"dist-ckpt: error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `dist-ckpt inspect DIR | head`: the reader left, nothing more to say
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit
        return 1
    except OSError as e:  # unreadable source, unwritable target, full disk: the system's words, one line
        print(f"dist-ckpt: error: {e}", file=sys.stderr)
        return 1


def _run(args: argparse.Namespace) -> int:
    """One command; errors are left to ``main``, which prints them as one line."""
    storage_options = _parse_storage_options(args.storage_options)
    if args.command == "demo":
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

        convert_checkpoint(args.src, args.dst, args.backend, args.version, storage_options=storage_options,
                           progress=_progress_bar("converting"))
        print(f"converted {args.src} -> {args.dst} ({args.backend} v{args.version})")
    elif args.command == "export":
        from .export import export_safetensors

        result = export_safetensors(args.src, args.dst, args.max_shard_size, args.include, args.dtype, args.rename,
                                    progress=_progress_bar("exporting"), storage_options=storage_options)
        print(f"exported {result.tensors} tensors ({result.total_size} bytes) of {args.src} -> {args.dst} "
              f"in {len(result.files)} safetensors files")
    elif args.command == "validate":
        from .checkpoint_check import validate_checkpoint

        report = validate_checkpoint(args.directory, storage_options=storage_options,
                                     progress=_progress_bar("verifying", unit="file"))
        for warning in report.warnings:
            print(f"warning: {warning}")
        for problem in report.problems:
            print(f"PROBLEM: {problem}")
        print(f"{args.directory}: {'OK' if report.ok else 'INVALID'} ({report.checksums_verified} checksums "
              f"verified in {report.files_checked} files, {len(report.problems)} problems)")
        return 0 if report.ok else 1
    elif args.command == "clean":
        from pathlib import Path

        from .commit import clean as clean_leftovers
        from .object_store import clean_url, is_url

        removed = (clean_url(args.path, storage_options) if is_url(args.path)
                   else clean_leftovers(Path(args.path)))
        for path in removed:
            print(f"removed {path}")
        print(f"{len(removed)} leftover(s) removed")
    elif args.command == "strategies":
        from .strategies.base import list_strategies

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

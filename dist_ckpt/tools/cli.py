"""The ``dist-ckpt`` command: ``demo``, ``inspect``, ``diff``, ``convert``, ``export``, ``validate``, ``clean``, ``strategies``."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from typing import Any, List, Optional

from .wording import counted

__all__ = ["main", "run"]


def _inspect(source: str, storage_options: Optional[dict], as_json: bool) -> None:
    import json

    from .inspection import format_summary, summarize_checkpoint

    _refuse_a_run_root(source, storage_options, "inspect")
    summary = summarize_checkpoint(source, storage_options)
    print(json.dumps(summary.to_json(), indent=2) if as_json else format_summary(summary))


def _ls(run: str, storage_options: Optional[dict], local_dir: Optional[str], as_json: bool) -> None:
    import json

    from .listing import format_listing, list_run

    listing = list_run(run, storage_options, local_dir)
    print(json.dumps(listing.to_json(), indent=2) if as_json else format_listing(listing))


def _refuse_a_run_root(source: str, storage_options: Optional[dict], command: str) -> None:
    """A run's directory of checkpoints given where one checkpoint is expected: say so, and
    name ``ls`` (which lists them) and one of them to give instead."""
    from ..core import CheckpointNotFoundError
    from ..storage.object_store import is_url
    from .listing import checkpoints_in

    if not is_url(source) and not os.path.isdir(source):
        return
    inside = checkpoints_in(source, storage_options)
    if inside:
        raise CheckpointNotFoundError(
            f"{source} is a run's directory of {len(inside)} checkpoint(s) ({', '.join(inside[:3])}"
            f"{', ...' if len(inside) > 3 else ''}), not one checkpoint: `dist-ckpt ls {source}` lists them, "
            f"`dist-ckpt {command} {source.rstrip('/')}/{inside[-1]}` {command}s one")


def _require_existing(path: str) -> None:
    """A local path that does not exist, named in one line (a URL is left to its store)."""
    from ..core import CheckpointNotFoundError
    from ..storage.object_store import is_url

    if is_url(path):
        return
    try:
        os.stat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} does not exist") from None
    except OSError:  # unreadable (permissions): the command meets it and says so in the system's words
        pass


def _require_save_backend(backend: str) -> None:
    """``--backend`` names a registered save backend; else argparse's words for a bad choice."""
    from ..strategies.base import StrategyAction, list_strategies

    backends = sorted({info.backend for info in list_strategies() if info.action == StrategyAction.SAVE_SHARDED})
    if backend not in backends:
        raise _UsageError(f"argument --backend: invalid choice: {backend!r} "
                          f"(choose from {', '.join(repr(b) for b in backends)})")


class _UsageError(ValueError):
    """A bad option value found once the library is imported: exit code 2, as argparse's."""


class _Terminated(BaseException):
    """SIGTERM, turned into an exception so that cleanup (``finally``) runs. A BaseException on
    purpose, like KeyboardInterrupt: an ``except Exception`` in a strategy, a plugin or a
    cleanup path must not swallow a termination and carry on; ``main`` catches it (exit 143)."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise _Terminated()


def main(argv: Optional[List[str]] = None) -> int:
    """Run one command; returns the exit code. Errors are one line on stderr, never a traceback:
    1 for a failure, 2 for bad options, 130 after Ctrl-C, 143 after SIGTERM."""
    from dist_ckpt_cli import build_parser

    return run(build_parser().parse_args(argv))


def run(args: argparse.Namespace) -> int:
    """Run the command ``args`` (``dist_ckpt_cli.build_parser``'s) names; returns the exit code."""
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
    except _UsageError as e:
        print(f"dist-ckpt {args.command}: error: {e} (see dist-ckpt {args.command} --help)", file=sys.stderr)
        return 2
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
    elif args.command == "ls":
        _ls(args.run, storage_options, args.local_dir, args.json)
    elif args.command == "inspect":
        _inspect(args.directory, storage_options, args.json)
    elif args.command == "diff":
        from .diff import diff_checkpoints, format_report

        for side in (args.a, args.b):
            _require_existing(side)
        differences = diff_checkpoints(args.a, args.b, storage_options=storage_options,
                                       progress=_progress_bar("comparing"), tensors_only=args.tensors_only)
        print(format_report(args.a, args.b, differences))
        return 0 if differences.same else 1
    elif args.command == "convert":
        from .convert import convert_checkpoint

        _require_save_backend(args.backend)
        _require_existing(args.src)
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
        print(f"exported {counted(result.tensors, 'tensor')} ({result.total_size} bytes) of {args.src} -> {args.dst} "
              f"in {counted(len(result.files), 'safetensors file')}")
    elif args.command == "validate":
        from .check import validate_checkpoint

        _require_existing(args.directory)
        _refuse_a_run_root(args.directory, storage_options, "validate")
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
        print(f"{counted(len(removed), 'leftover')} removed")
    elif args.command == "strategies":
        from ..strategies.base import STRATEGY_TABLE_HEADER, list_strategies

        print(STRATEGY_TABLE_HEADER)
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

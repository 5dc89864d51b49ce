"""Per-phase wall times of the library's long operations, for ``dist-ckpt -v`` and ``progress=True``.

Operations mark their phases with ``phase("name")``; nothing is recorded unless a caller opened
``recording()`` (the CLI's ``-v``), so the marks cost a context-variable lookup otherwise. With
``progress``, rank 0 on a terminal also shows each phase as it starts (tqdm).
"""

from __future__ import annotations

import contextlib
import sys
import time
from contextvars import ContextVar
from typing import Dict, Iterator, List, Optional, Tuple

__all__ = ["PhaseTimes", "phase", "recording", "format_table", "progress_display"]


class PhaseTimes:
    """Seconds per phase, in the order phases first ran (a repeated phase adds up)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self.calls: Dict[str, int] = {}

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def rows(self) -> List[Tuple[str, float, int]]:
        return [(name, s, self.calls[name]) for name, s in self.seconds.items()]


_recorder: ContextVar[Optional[PhaseTimes]] = ContextVar("dist_ckpt_phase_times", default=None)
_display: ContextVar[Optional[object]] = ContextVar("dist_ckpt_phase_display", default=None)


@contextlib.contextmanager
def recording() -> Iterator[PhaseTimes]:
    """Record the phases of everything run inside (this thread / task)."""
    times = PhaseTimes()
    token = _recorder.set(times)
    try:
        yield times
    finally:
        _recorder.reset(token)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    times, display = _recorder.get(), _display.get()
    if display is not None:
        display.set_description_str(name)  # type: ignore[attr-defined]
    if times is None:
        yield
        if display is not None:
            display.update(1)  # type: ignore[attr-defined]
        return
    start = time.perf_counter()
    try:
        yield
    finally:
        times.add(name, time.perf_counter() - start)
        if display is not None:
            display.update(1)  # type: ignore[attr-defined]


@contextlib.contextmanager
def progress_display(enabled: bool, what: str, phases: int, rank: int = 0) -> Iterator[None]:
    """A tqdm bar over ``phases`` steps, on rank 0 and a terminal only; else nothing."""
    if not enabled or rank != 0 or not sys.stderr.isatty():
        yield
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield
        return
    bar = tqdm(total=phases, desc=what, unit="phase", file=sys.stderr, leave=False)
    token = _display.set(bar)
    try:
        yield
    finally:
        _display.reset(token)
        bar.close()


def format_table(times: PhaseTimes) -> str:
    """The table ``-v`` prints: phase, seconds, share of the total, calls."""
    rows = times.rows()
    total = sum(s for _, s, _ in rows) or 1e-12
    width = max([len("phase")] + [len(n) for n, _, _ in rows])
    lines = [f"{'phase':<{width}}  {'seconds':>9}  {'share':>6}  calls"]
    lines += [f"{n:<{width}}  {s:9.3f}  {100 * s / total:5.1f}%  {c:5d}" for n, s, c in rows]
    lines.append(f"{'total':<{width}}  {sum(s for _, s, _ in rows):9.3f}")
    return "\n".join(lines)

"""Benchmark tables written into the documentation by the scripts that measured them.

``run.py --write-docs`` and ``simulate_scale.py --write-docs`` replace the text between the
markers ``<!-- benchmark:NAME -->`` and ``<!-- /benchmark:NAME -->`` in docs/performance.md with
a Markdown table of the run just made, headed by the machine it ran on, so the documentation
never shows numbers that no command produced.
"""

from __future__ import annotations

import os
import platform
import re
from pathlib import Path
from typing import Iterable, List, Sequence

__all__ = ["machine_description", "markdown_table", "replace_section", "PERFORMANCE_PAGE"]

PERFORMANCE_PAGE = Path(__file__).resolve().parent.parent / "docs" / "performance.md"


def _first(path: str, key: str) -> str:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _file_system(directory: Path) -> str:
    """The type and device of the mount holding ``directory`` (longest matching mount point)."""
    best = ("", "", "")
    try:
        for line in Path("/proc/mounts").read_text().splitlines():
            device, mount, kind = line.split()[:3]
            if str(directory.resolve()).startswith(mount) and len(mount) > len(best[1]):
                best = (device, mount, kind)
    except OSError:
        return "unknown file system"
    return f"{best[2]} on {best[0]}"


def machine_description(directory: Path) -> str:
    """One line naming the machine: CPU, cores, memory, virtualization, the file system the
    benchmark wrote to, Python and torch (and megatron-core when installed)."""
    import torch

    cpu = _first("/proc/cpuinfo", "model name") or platform.processor() or platform.machine()
    flags = _first("/proc/cpuinfo", "flags").split()
    memory_kib = _first("/proc/meminfo", "MemTotal").split()
    memory = f"{int(memory_kib[0]) / 2**20:.0f} GiB" if memory_kib else "? GiB"
    parts = [f"{cpu} ({platform.machine()}{', a VM' if 'hypervisor' in flags else ''})",
             f"{os.cpu_count()} cores", memory, _file_system(directory),
             f"Python {platform.python_version()}", f"torch {torch.__version__}"]
    try:
        from importlib.metadata import version

        parts.append(f"megatron-core {version('megatron-core')}")
    except Exception:  # noqa: BLE001 - not installed: not named
        pass
    return ", ".join(parts)


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]], right: Sequence[int] = ()) -> List[str]:
    """A Markdown table; columns whose index is in ``right`` are right-aligned."""
    align = ["---:" if i in right else "---" for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def replace_section(name: str, lines: Sequence[str], page: Path = PERFORMANCE_PAGE) -> None:
    """Put ``lines`` between the page's markers for ``name`` (they must exist: a section is
    placed by hand once, then kept up to date by the script)."""
    start, end = f"<!-- benchmark:{name} -->", f"<!-- /benchmark:{name} -->"
    text = page.read_text()
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if not pattern.search(text):
        raise SystemExit(f"{page} has no section {start} ... {end}: add the two markers where the table goes")
    body = "\n".join([start, *lines, end])
    page.write_text(pattern.sub(lambda _: body, text, count=1))

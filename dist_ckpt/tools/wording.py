"""How the commands write numbers for people: "1 rank" and "2 ranks", "3.1 MiB", "5 min ago"."""

from __future__ import annotations

from typing import Any, Mapping, Optional

__all__ = ["counted", "human_size", "human_age", "format_metrics"]


def counted(count: int, noun: str, plural: Optional[str] = None) -> str:
    """``counted(1, "problem")`` is "1 problem", ``counted(2, "problem")`` "2 problems"."""
    return f"{count} {noun if count == 1 else plural or noun + 's'}"


def human_size(nbytes: float) -> str:
    """Bytes in binary units: "512 B", "3.1 MiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return f"{nbytes:.1f} TiB"


def human_age(seconds: Optional[float]) -> str:
    """An age in the largest whole unit: "40 s", "5 min", "3 h", "2 d"; "?" when unknown."""
    if seconds is None:
        return "?"
    seconds = max(0.0, seconds)
    for unit, length in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds >= length:
            return f"{int(seconds // length)} {unit}"
    return f"{int(seconds)} s"


def format_metrics(metrics: Optional[Mapping[str, Any]]) -> str:
    """Recorded metrics as "val_loss=1.93 tokens=2e+09" (numbers to 4 significant digits); "" for none."""
    if not metrics:
        return ""
    return " ".join(f"{name}={value:.4g}" if isinstance(value, float) else f"{name}={value}"
                    for name, value in metrics.items())

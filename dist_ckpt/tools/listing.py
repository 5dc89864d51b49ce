"""``dist-ckpt ls RUN``: every checkpoint of a run (a directory or URL of ``iter_XXXXXXX/``), as
the ``CheckpointManager`` and a resume see it, and the steps of its local tier.

Per checkpoint: its step, its state - committed (``metadata.json`` inside; the tracker's choice
marked), incomplete (data without ``metadata.json``: a save in progress or cut short), or a
leftover of an interrupted save, overwrite or deletion (``.iter_XXXXXXX.dist_ckpt-...`` beside
it; ``dist-ckpt clean`` removes those) - its size and file count, the software that wrote it
(``dist_ckpt_writer.json``) and its age. Nothing is unpickled and no tensor is read: a listing of
a run on an object store costs one listing per checkpoint and one small read of each writer
record.

With the local tier's directory (``--local-dir``, the manager's ``local_dir``): per session, the
steps whose parts are there, which owners' parts each has (own or copies), and whether it is
complete (every rank's part somewhere: a resume can use it).
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Set, Union

from ..core import CONFIG_FNAME, CheckpointNotFoundError
from ..local.manager import parse_part_name
from ..storage.leftovers import DELETING_MARK, OLD_MARK, STAGING_MARK
from ..storage.run_names import RELEASE, default_local_session, read_tracker, step_of_checkpoint_dir
from ..storage.run_root import RunRoot, StoredFile, open_run_root
from ..storage.metrics_record import METRICS_FNAME, parse_metrics_record
from ..storage.writer_record import WRITER_FNAME, parse_writer_record
from .wording import counted, format_metrics, human_age, human_size

__all__ = ["CheckpointListing", "LocalSession", "RunListing", "list_run", "format_listing", "checkpoints_in"]

_LEFTOVER_NAME = re.compile(r"\.(iter_\d+|release)(\.dist_ckpt-(?:staging|old|deleting)-.*)")
_LEFTOVER_KINDS = {STAGING_MARK: "leftover of an interrupted save",
                   OLD_MARK: "leftover of an interrupted overwrite (the checkpoint it replaced)",
                   DELETING_MARK: "leftover of an interrupted deletion"}


@dataclass
class CheckpointListing:
    """One checkpoint directory (or leftover) of a run."""

    name: str
    step: Union[int, str]
    state: str  # "committed", "incomplete", "no checkpoint data" (other files), "empty" or "leftover of ..."
    tracker: bool  # the tracker names it (a resume loads it first)
    bytes: int
    files: int
    writer: Optional[Dict[str, str]]  # dist_ckpt, torch, python; None: not recorded
    modified: Optional[float]  # the newest file's time, seconds since the epoch
    metrics: Optional[Dict[str, Any]] = None  # what save(metrics=...) recorded; None: nothing


@dataclass
class LocalSession:
    """One session of a local tier directory: ``<local_dir>/<session>/<rank>/``."""

    session: str
    this_run: bool  # the session a CheckpointManager of this run uses by default
    ranks: int
    steps: Dict[int, List[int]] = field(default_factory=dict)  # step -> owners whose part is there
    unfinished: Dict[int, int] = field(default_factory=dict)  # step -> parts still being written (.dirty)

    def complete(self, step: int) -> bool:
        return set(self.steps.get(step, [])) == set(range(self.ranks))


@dataclass
class RunListing:
    run: str
    tracker: Optional[Union[int, str]]
    checkpoints: List[CheckpointListing]
    local_dir: Optional[str] = None
    local: List[LocalSession] = field(default_factory=list)
    listed_at: float = field(default_factory=time.time)

    def to_json(self) -> Dict[str, Any]:
        out = asdict(self)
        for session, entry in zip(self.local, out["local"]):
            entry["steps"] = [{"step": step, "owners": owners, "complete": session.complete(step),
                               "unfinished_parts": session.unfinished.get(step, 0)}
                              for step, owners in sorted(session.steps.items())]
            del entry["unfinished"]
        return out


def _sort_key(listing: CheckpointListing) -> Any:
    return (1 if listing.step == RELEASE else 0, listing.step if isinstance(listing.step, int) else 0,
            0 if listing.state == "committed" else 1)


def _small_file(root: RunRoot, name: str, file: str) -> Optional[str]:
    """One of the checkpoint's small records (writer, metrics), or None where it cannot be read:
    a listing describes, it never fails on a damaged record."""
    try:
        return root.read_text(f"{name}/{file}")
    except (OSError, UnicodeDecodeError, CheckpointNotFoundError):
        return None


def _writer(root: RunRoot, name: str) -> Optional[Dict[str, str]]:
    """The checkpoint's writer record as a dict, or None where it has none (best effort)."""
    raw = _small_file(root, name, WRITER_FNAME)
    record = parse_writer_record(raw.encode()) if raw is not None else None
    return None if record is None else {"dist_ckpt": record.dist_ckpt, "torch": record.torch,
                                        "python": record.python}


def _metrics(root: RunRoot, name: str) -> Optional[Dict[str, Any]]:
    """What the checkpoint's save recorded in ``dist_ckpt_metrics.json`` (best effort)."""
    raw = _small_file(root, name, METRICS_FNAME)
    return parse_metrics_record(raw) if raw is not None else None


def _describe(root: RunRoot, name: str, step: Union[int, str], state: str, tracker: bool,
              files: List[StoredFile]) -> CheckpointListing:
    writer, metrics = None, None
    if state == "committed":
        data = root.data_of(name)
        if data != name:  # an object store's: the save its pointer names (not the one it replaced)
            files = [f for f in files if f.path == CONFIG_FNAME or f.path.startswith(data[len(name) + 1:] + "/")]
        writer = _writer(root, data)
        metrics = _metrics(root, data)
    times = [f.modified for f in files if f.modified is not None]
    return CheckpointListing(name, step, state, tracker, sum(f.size for f in files), len(files), writer,
                             max(times) if times else None, metrics)


def checkpoints_in(source: Union[str, os.PathLike], storage_options: Optional[dict] = None) -> List[str]:
    """The checkpoint directories directly inside ``source`` when it is a run's root rather than
    one checkpoint (no ``metadata.json`` of its own); else an empty list."""
    root = open_run_root(source, storage_options)
    if root.read_text(CONFIG_FNAME) is not None:
        return []
    return sorted(e for e in root.entries() if step_of_checkpoint_dir(e) is not None)


def list_run(run: Union[str, os.PathLike], storage_options: Optional[dict] = None,
             local_dir: Union[str, os.PathLike, None] = None) -> RunListing:
    """Everything ``dist-ckpt ls`` shows for the run at ``run`` (a directory or URL)."""
    root = open_run_root(run, storage_options)
    entries = root.entries()
    if not entries and not (isinstance(run, str) and "://" in run) and not Path(run).is_dir():
        raise CheckpointNotFoundError(f"{run} does not exist")
    tracker = read_tracker(root)
    committed = set(root.committed())
    listings = []
    for name in entries:
        step = step_of_checkpoint_dir(name)
        if step is not None:
            files = root.files(name)
            state = ("committed" if name in committed else "incomplete" if root.holds_checkpoint_data(name)
                     else "no checkpoint data" if files else "empty")
            listings.append(_describe(root, name, step, state, state == "committed" and step == tracker, files))
            continue
        match = _LEFTOVER_NAME.fullmatch(name)
        leftover_of = step_of_checkpoint_dir(match.group(1)) if match else None
        if match and leftover_of is not None:
            kind = next(text for mark, text in _LEFTOVER_KINDS.items() if match.group(2).startswith(mark))
            listings.append(_describe(root, name, leftover_of, kind, False, root.files(name)))
    listing = RunListing(str(root), tracker, sorted(listings, key=_sort_key))
    if local_dir is not None:
        listing.local_dir = os.fspath(local_dir)
        listing.local = _local_sessions(Path(local_dir), default_local_session(str(root)))
    return listing


def _local_sessions(local_dir: Path, this_run: str) -> List[LocalSession]:
    if not local_dir.is_dir():
        raise CheckpointNotFoundError(f"the local tier's directory {local_dir} does not exist")
    sessions = []
    for session_dir in sorted(p for p in local_dir.iterdir() if p.is_dir()):
        rank_dirs = [p for p in session_dir.iterdir() if p.is_dir() and p.name.isdigit()]
        if not rank_dirs:
            continue
        session = LocalSession(session_dir.name, session_dir.name == this_run,
                               max(int(p.name) for p in rank_dirs) + 1)
        owners: Dict[int, Set[int]] = {}
        for rank_dir in rank_dirs:
            for part in rank_dir.iterdir():
                parsed = parse_part_name(part.name)
                if parsed is None:
                    continue
                step, owner, being_written = parsed
                if being_written:
                    session.unfinished[step] = session.unfinished.get(step, 0) + 1
                    owners.setdefault(step, set())
                else:
                    owners.setdefault(step, set()).add(owner)
        session.steps = {step: sorted(found) for step, found in sorted(owners.items())}
        sessions.append(session)
    return sessions


def format_listing(listing: RunListing) -> str:
    """What ``dist-ckpt ls`` prints: a header line, one row per checkpoint, the local tier."""
    committed = [c for c in listing.checkpoints if c.state == "committed"]
    tracker = ("no tracker" if listing.tracker is None else f"the tracker names step {listing.tracker}"
               + ("" if any(c.tracker for c in committed) else " (not committed here)"))
    lines = [f"{listing.run}: {counted(len(committed), 'checkpoint')} committed, {tracker}"]
    if listing.checkpoints:
        with_metrics = any(c.metrics for c in listing.checkpoints)  # a column only for runs that record them
        rows = [("STEP", "STATE", "SIZE", "FILES", "WRITTEN BY", "AGE", "METRICS" if with_metrics else "")]
        for c in listing.checkpoints:
            state = c.state + (", the tracker's" if c.tracker else "")
            if c.state.startswith("leftover"):
                state += f": {c.name}"
            writer = (f"dist_ckpt {c.writer['dist_ckpt']}, torch {c.writer['torch'].split('+')[0]}" if c.writer
                      else "not recorded" if c.state == "committed" else "")
            age = human_age(listing.listed_at - c.modified) if c.modified is not None else "?"
            rows.append((str(c.step), state, human_size(c.bytes), str(c.files), writer, age, format_metrics(c.metrics)))
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        for row in rows:
            cells = [row[0].rjust(widths[0]), row[1].ljust(widths[1]), row[2].rjust(widths[2]),
                     row[3].rjust(widths[3]), row[4].ljust(widths[4]), row[5].rjust(widths[5]), row[6]]
            lines.append("  " + "  ".join(cells).rstrip())
    if any(c.state.startswith("leftover") for c in listing.checkpoints):
        lines.append(f"  leftovers are removed by the next save's retention, or now by: dist-ckpt clean {listing.run}")
    if listing.local_dir is not None:
        lines.append(f"local tier in {listing.local_dir}: "
                     + (counted(len(listing.local), "session") if listing.local else "no parts"))
        for session in listing.local:
            steps = []
            for step, owners in session.steps.items():
                if session.complete(step):
                    text = f"{step} complete"
                elif owners:
                    text = f"{step} partial (parts of {counted(len(owners), 'rank')}: {', '.join(map(str, owners))})"
                else:
                    text = f"{step} partial"
                if session.unfinished.get(step):
                    text += f", {counted(session.unfinished[step], 'part')} being written or cut short"
                steps.append(text)
            mark = "this run's, " if session.this_run else ""
            lines.append(f"  session {session.session} ({mark}{counted(session.ranks, 'rank')}): "
                         + ("; ".join(f"step {s}" for s in steps) if steps else "no parts"))
    return "\n".join(lines)

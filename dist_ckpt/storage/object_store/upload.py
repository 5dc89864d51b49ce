"""Saves to a URL: a save directory per save, uploaded by every rank, committed by one PUT.

``begin_remote_save`` (coordinator) checks the target and notes the pointer's ETag; every rank
writes into a local scratch directory and uploads its files (``RemoteSave.upload``; an
asynchronous save's background writer does it: ``WriteThenUpload``); the coordinator's
``RemoteSave.commit`` PUTs the pointer (conditionally on S3), then removes what that commit
replaced one generation ago. The protocol and its guarantees: ``object_store``'s docstring.
"""

from __future__ import annotations

import calendar
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set

from ...core import (
    CONFIG_FNAME,
    CheckpointExistsError,
    CheckpointingConfig,
    CheckpointingException,
    CheckpointNotFoundError,
    config_bytes,
    maybe_load_config,
)
from ...runtime.interrupts import interrupts_deferred
from ..entries import checkpoint_entries_of
from ..formats import describe_foreign, foreign_format_of
from ..leftovers import OVERWRITE_HINT
from ..lock import ConcurrentSaveError
from .store import (
    CONDITIONAL_PROTOCOLS,
    POINTER_FIELD,
    PREVIOUS_FIELD,
    SAVE_DIR_PREFIX,
    WRITER_LOCK,
    PreconditionFailed,
    StoreLocation,
    listing,
    open_location,
    pointer_etag,
    read_pointer,
)

logger = logging.getLogger(__name__)

__all__ = [
    "SAVE_GRACE_S",
    "RemoteSave",
    "WriteThenUpload",
    "written_files",
    "begin_remote_save",
    "clean_url",
    "files_owned",
    "scratch_listing",
    "scratch_root",
    "publish_checkpoint",
    "upload_files",
    "require_empty_prefix",
    "new_scratch_dir",
]


#: a save directory younger than this is never removed by another save's cleanup: a save that
#: began after that cleanup's commit (so its conditional commit can still win) may be uploading
#: its first objects while the cleanup lists. Minutes cover that window and clock skew between
#: machines; a URL re-saved more often than this keeps the directories of those saves until they
#: are older. DIST_CKPT_SAVE_GRACE_S overrides it.
SAVE_GRACE_S = 900.0
_SAVE_TIME = re.compile(rf"^{SAVE_DIR_PREFIX}(\d{{8}}T\d{{6}})-")


def _new_save_name() -> str:
    """``dist_ckpt-save-<UTC time>-<random>``: the time tells other writers its age (grace period)."""
    return f"{SAVE_DIR_PREFIX}{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{uuid.uuid4().hex[:8]}"


def _save_grace_s() -> float:
    try:
        return float(os.environ.get("DIST_CKPT_SAVE_GRACE_S", SAVE_GRACE_S))
    except ValueError:
        return SAVE_GRACE_S


def _is_young(save_name: str) -> bool:
    """Started less than the grace period ago (by the time in its name; names without one -
    saves of earlier releases - count as old)."""
    match = _SAVE_TIME.match(save_name)
    if match is None:
        return False
    started = calendar.timegm(time.strptime(match.group(1), "%Y%m%dT%H%M%S"))  # the name's time is UTC
    return time.time() - started < _save_grace_s()


def scratch_root() -> Path:
    return Path(os.environ.get("DIST_CKPT_SCRATCH") or tempfile.gettempdir()) / "dist_ckpt-scratch"


_SAVE_LOCATIONS: Dict[Any, StoreLocation] = {}
_SAVE_LOCATIONS_LOCK = threading.Lock()


@dataclass
class RemoteSave:
    """One save to a URL: its local scratch directory and its save directory in the store."""

    url: str
    save_name: str
    storage_options: Dict[str, Any]
    overwrite: Optional[bool] = None
    committed: bool = False  # the pointer names this save: its objects are the checkpoint now
    # the pointer when the save began: its ETag (the commit's condition) and the save it named
    pointer_etag: Optional[str] = None
    previous_save: Optional[str] = None

    @property
    def scratch(self) -> Path:
        return scratch_root() / self.save_name

    @property
    def destination_url(self) -> str:
        """The save directory in the store (``U/dist_ckpt-save-<id>``)."""
        return f"{self.url.rstrip('/')}/{self.save_name}"

    def location(self) -> StoreLocation:
        """The store, its client reused by the saves of this process to this URL (a new S3
        client costs about half a second of the training thread's finalization)."""
        key = (os.getpid(), self.url, json.dumps(self.storage_options, sort_keys=True, default=str),
               tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("AWS_"))))
        with _SAVE_LOCATIONS_LOCK:
            loc = _SAVE_LOCATIONS.get(key)
            if loc is None:
                if len(_SAVE_LOCATIONS) >= 16:
                    _SAVE_LOCATIONS.clear()
                loc = _SAVE_LOCATIONS[key] = open_location(self.url, self.storage_options)
        return loc

    def upload(self, names: Sequence[str], source: Optional[Path] = None) -> None:
        """Every rank: its files of the scratch directory (or ``source``) into the save directory."""
        if names:
            _put(self.location(), source or self.scratch, names, self.save_name)

    def commit(self, config: CheckpointingConfig) -> None:
        """Coordinator, after every rank uploaded: the pointer PUT, then the old objects go."""
        loc = self.location()
        conditional = loc.url.split("://", 1)[0] in CONDITIONAL_PROTOCOLS
        # (with a conditional PUT, the condition itself refuses a pointer written meanwhile)
        before = None if conditional else read_pointer(loc)
        if self.overwrite is False and before is not None:
            raise CheckpointExistsError(f"another save committed a checkpoint at {self.url} while this one ran; "
                                        f"this save was not committed ({OVERWRITE_HINT})")
        content = json.loads(config_bytes(config))
        content[POINTER_FIELD] = self.save_name
        if self.previous_save:
            content[PREVIOUS_FIELD] = self.previous_save
        condition: Dict[str, Any] = {}
        if conditional:
            condition = {"IfMatch": self.pointer_etag} if self.pointer_etag else {"IfNoneMatch": "*"}
        with interrupts_deferred():  # a Ctrl-C must not send abort() after the PUT
            try:
                loc.call(f"writing {CONFIG_FNAME} (the commit)", "pipe_file", loc.child(CONFIG_FNAME),
                         json.dumps(content).encode(), **condition)
            except PreconditionFailed:
                raise ConcurrentSaveError(
                    f"another writer committed a checkpoint at {self.url} while this save ran; this save was not "
                    f"committed and its objects are removed (the other checkpoint is intact; one writer per URL)"
                ) from None
            self.committed = True
        self._release_writer_lock(loc)
        _remove_replaced(loc, keep={self.save_name, self.previous_save or ""})

    def _release_writer_lock(self, loc: StoreLocation) -> None:
        if loc.url.split("://", 1)[0] in CONDITIONAL_PROTOCOLS:
            return
        try:
            lock = json.loads(loc.call("reading the writer lock", "cat_file", loc.child(WRITER_LOCK)))
            if lock.get("save") == self.save_name:
                loc.call("removing the writer lock", "rm", loc.child(WRITER_LOCK))
        except (CheckpointingException, ValueError) as e:
            logger.debug("%s: writer lock not removed: %s", self.url, e)

    def abort(self) -> None:
        """Coordinator: remove what this save uploaded (best effort; ``clean_url`` later), unless
        it was committed (a failure in the removal of the replaced objects comes after that)."""
        shutil.rmtree(self.scratch, ignore_errors=True)
        if self.committed:
            return
        try:
            loc = self.location()
            self._release_writer_lock(loc)
            loc.call(f"removing {self.save_name}", "rm", loc.child(self.save_name), recursive=True)
        except Exception as e:  # already gone, or the store is unreachable: the next save cleans
            logger.debug("could not remove %s/%s: %s", self.url, self.save_name, e)


def written_files(write_result: Any) -> List[str]:
    """The files a background write reported writing (the ``file`` of the manifest entries it
    returns, as ``(results, entries)``), or [] for a write that reports none."""
    try:
        return sorted({entry.file for entry in write_result[1]})
    except (TypeError, IndexError, AttributeError, KeyError):
        return []


@dataclass
class WriteThenUpload:
    """An asynchronous save's background write to a URL, followed - in the same background
    thread or writer process - by the upload of the files it wrote (``written_files``). The
    training thread's finalization then only completes the checkpoint (the coordinator's small
    files) and PUTs the pointer, instead of uploading every byte while training waits.
    Picklable (the persistent writer process runs it)."""

    write: Callable[..., Any]
    remote: RemoteSave

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        result = self.write(*args, **kwargs)
        self.remote.upload(written_files(result))
        return result


def _put(loc: StoreLocation, source: Path, names: Sequence[str], under: str = "") -> None:
    prefix = loc.child(under) if under else loc.path
    loc.call(f"uploading {len(names)} files", "put", [str(source / n) for n in names], [f"{prefix}/{n}" for n in names],
             nbytes=sum((source / n).stat().st_size for n in names))


def publish_checkpoint(local: Path, remote: RemoteSave) -> None:
    """One process: a complete local checkpoint directory (``convert``'s output) to the URL of
    ``remote`` (from ``begin_remote_save``), with the same commit as a save."""
    config = maybe_load_config(local)
    if config is None:  # pragma: no cover - the caller committed it
        raise CheckpointingException(f"{local} is not a committed checkpoint")
    remote.upload(sorted(scratch_listing(local)), source=local)
    remote.commit(config)


EXPORT_CLAIM = "dist_ckpt-export.json"  # held at a prefix while an export uploads into it


def upload_files(local: Path, url: str, storage_options: Optional[Mapping[str, Any]], last: Sequence[str]) -> None:
    """A directory of plain files (an export) to an empty ``url``, the names ``last`` after the
    others (the index of a safetensors export, which readers follow).

    Two exports racing to one prefix would upload shard files of the same names over each
    other, and the index that lands last could name the other one's shards. So the upload
    claims the prefix first (``EXPORT_CLAIM``, created only if absent: S3's ``If-None-Match``;
    elsewhere checked, then written) and lists it again: the second export is refused with
    ``ConcurrentSaveError``, or ``CheckpointExistsError`` once the first one's files are there,
    before it uploads anything. The claim goes when the upload ends."""
    loc = require_empty_prefix(url, storage_options)
    _claim_for_export(loc, url)
    try:
        names = sorted(scratch_listing(local))
        _put(loc, local, [n for n in names if n not in last])
        _put(loc, local, [n for n in names if n in last])
    finally:
        _release_export_claim(loc, url)


def _claim_for_export(loc: StoreLocation, url: str) -> None:
    conditional = loc.url.split("://", 1)[0] in CONDITIONAL_PROTOCOLS
    claim = json.dumps({"export": uuid.uuid4().hex, "host": os.uname().nodename, "pid": os.getpid(),
                        "started": time.time()}).encode()
    condition: Dict[str, Any] = {"IfNoneMatch": "*"} if conditional else {}
    try:
        loc.call("claiming the prefix for the export", "pipe_file", loc.child(EXPORT_CLAIM), claim, **condition)
    except PreconditionFailed:
        raise ConcurrentSaveError(f"another export is uploading to {url} right now; export to a new prefix") from None
    if set(listing(loc, loc.path, skip_save_dirs=False)) - {EXPORT_CLAIM}:  # one that ended in between
        _release_export_claim(loc, url)
        raise CheckpointExistsError(f"{url} holds objects already; export to a new prefix")


def _release_export_claim(loc: StoreLocation, url: str) -> None:
    try:
        loc.call("removing the export's claim", "rm", loc.child(EXPORT_CLAIM))
    except CheckpointingException as e:  # no answer: the claim may stay, naming this export (clean by hand)
        logger.warning("%s: %s not removed: %s", url, EXPORT_CLAIM, e)


def require_empty_prefix(url: str, storage_options: Optional[Mapping[str, Any]]) -> StoreLocation:
    """Refuse a target prefix that holds objects (checked before an export starts, and again
    before its upload)."""
    loc = open_location(url, storage_options)
    if listing(loc, loc.path, skip_save_dirs=False):
        raise CheckpointExistsError(f"{url} holds objects already; export to a new prefix")
    return loc


def new_scratch_dir(what: str) -> Path:
    """A fresh local directory for a one-process job that ends in an upload."""
    path = scratch_root() / f"{what}-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    return path


def _remove_replaced(loc: StoreLocation, keep: Set[str]) -> List[str]:
    """After the commit: other save directories (but ``keep``: the new one and the one it
    replaced, and young ones) and a replaced plain checkpoint's files."""
    loc.fs.invalidate_cache(loc.path)
    removed = _remove_interrupted(loc, keep)
    root_files = {rel for rel in listing(loc, loc.path, skip_save_dirs=True) if rel != CONFIG_FNAME}
    entries = checkpoint_entries_of(root_files)  # a replaced checkpoint uploaded as a plain directory
    stale = sorted(rel for rel in root_files if rel.split("/", 1)[0] in entries)
    if stale:
        loc.call("removing the replaced checkpoint's files", "rm", [loc.child(n) for n in stale])
        removed.extend(stale)
    return removed


def begin_remote_save(url: str, overwrite: Optional[bool], storage_options: Optional[Mapping[str, Any]]) -> RemoteSave:
    """Coordinator: check the target, note the pointer (the commit's condition), pick the save id."""
    loc = open_location(url, storage_options)
    etag = pointer_etag(loc)
    pointer = read_pointer(loc)
    if pointer is not None:
        if overwrite is False:
            raise CheckpointExistsError(f"{url} already holds a committed checkpoint ({CONFIG_FNAME} exists); save "
                                        f"to a new URL, or replace it: {OVERWRITE_HINT}")
        if overwrite is None:
            logger.warning("%s holds a committed checkpoint; it will be replaced when this save commits", url)
    nested = [p for p in loc.call("listing objects", "glob", loc.child(f"*/{CONFIG_FNAME}"))
              if not p[len(loc.path):].lstrip("/").startswith(SAVE_DIR_PREFIX)]
    if nested:
        names = ", ".join(p[len(loc.path):].strip("/").split("/")[0] for p in nested[:5])
        raise CheckpointExistsError(f"{url} holds other checkpoints ({names}); a checkpoint cannot contain "
                                    f"checkpoints - save to a new prefix such as {url.rstrip('/')}/iter_0000001")
    if pointer is None:
        foreign = foreign_format_of([r for r in listing(loc, loc.path, skip_save_dirs=True) if "/" not in r])
        if foreign is not None and overwrite is not True:
            raise CheckpointExistsError(
                f"{url} holds a {describe_foreign(foreign)} written by another tool (not a dist_ckpt save); nothing "
                f"was written. Save to another URL, or pass overwrite=True to replace it (its files of other "
                f"formats are kept)")
        _remove_interrupted(loc, keep=set())
    current = pointer.get(POINTER_FIELD) if pointer else None
    remote = RemoteSave(loc.url, _new_save_name(), dict(storage_options or {}), overwrite, pointer_etag=etag,
                        previous_save=current if isinstance(current, str) else None)
    if loc.url.split("://", 1)[0] not in CONDITIONAL_PROTOCOLS:
        _take_writer_lock(loc, remote.save_name)
    return remote


def _take_writer_lock(loc: StoreLocation, save_name: str) -> None:
    """Stores without conditional writes: refuse when another save holds the lock object (and
    is younger than the grace period), then write ours. Best effort: two requests, not atomic."""
    try:
        held = json.loads(loc.call("reading the writer lock", "cat_file", loc.child(WRITER_LOCK))).get("save", "")
    except CheckpointNotFoundError:
        held = ""
    except ValueError:
        held = ""
    if held and held != save_name and _is_young(held):
        raise ConcurrentSaveError(f"another save ({held}) is writing {loc.url} right now ({WRITER_LOCK}); wait for it "
                                  f"or save elsewhere (this store has no conditional writes: one writer per URL)")
    loc.call("writing the writer lock", "pipe_file", loc.child(WRITER_LOCK),
             json.dumps({"save": save_name, "host": os.uname().nodename, "pid": os.getpid()}).encode())


def _remove_interrupted(loc: StoreLocation, keep: Set[str]) -> List[str]:
    """Save directories other than ``keep`` and older than the grace period (a younger one may
    belong to a save still uploading): left by saves killed before their commit, or replaced."""
    try:
        children = loc.call("listing objects", "ls", loc.path, detail=False)
    except CheckpointNotFoundError:
        return []
    removed = []
    for child in children:
        name = child.rstrip("/").rsplit("/", 1)[-1]
        if name.startswith(SAVE_DIR_PREFIX) and name not in keep and not _is_young(name):
            loc.call(f"removing {name}", "rm", child, recursive=True)
            removed.append(name)
    return removed


def clean_url(url: str, storage_options: Optional[Mapping[str, Any]] = None) -> List[str]:
    """Remove the objects interrupted saves left at ``url`` (never the committed checkpoint)."""
    loc = open_location(url, storage_options)
    pointer = read_pointer(loc)
    if pointer is None and not listing(loc, loc.path, skip_save_dirs=False):
        raise CheckpointNotFoundError(f"{url}: nothing there")
    keep = {str(pointer.get(POINTER_FIELD, "")), str(pointer.get(PREVIOUS_FIELD, ""))} if pointer else set()
    return [f"{loc.url}/{name}" for name in _remove_interrupted(loc, keep)]


def files_owned(entries_per_rank: List[List[Any]], listing: Set[str], coordinator: int) -> List[List[str]]:
    """Which files each rank uploads: those its manifest entries name; the coordinator also
    takes every file of its scratch directory no other rank's entries name (metadata.json,
    the manifest, ``.metadata``, zarr array headers)."""
    owned = [sorted({e.file for e in entries}) for entries in entries_per_rank]
    claimed = {f for r, files in enumerate(owned) if r != coordinator for f in files}
    owned[coordinator] = sorted((set(owned[coordinator]) | listing) - claimed)
    return owned


def scratch_listing(scratch: Path) -> Set[str]:
    """Every file under ``scratch``, relative, with ``/`` separators."""
    return {str(p.relative_to(scratch)) for p in scratch.rglob("*") if p.is_file()}

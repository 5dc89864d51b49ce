"""Loads from a URL: the checkpoint the pointer names, copied once per machine into a local cache.

Ranks of one machine share the cache (``DIST_CKPT_CACHE``, default ``~/.cache/dist_ckpt``); the
first downloads under a file lock into a ``.partial-*`` directory renamed into place when whole.
A save directory never changes, so a cached copy is reused until the pointer moves; plain
directory uploads and foreign formats are cached under a digest of their object listing.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional

from ...core import (
    COMMON_STATE_FNAME,
    CONFIG_FNAME,
    DCP_METADATA_FNAME,
    CheckpointingException,
    CheckpointNotFoundError,
)
from ..formats import foreign_format_of
from ..locations import TRACKER_FNAME
from .store import (
    POINTER_FIELD,
    SAVE_DIR_PREFIX,
    PathOrUrl,
    StoreLocation,
    is_url,
    listing,
    local_path,
    open_location,
    read_pointer,
)

logger = logging.getLogger(__name__)

__all__ = ["local_copy", "localize", "cache_root"]


def cache_root() -> Path:
    return Path(os.environ.get("DIST_CKPT_CACHE") or Path.home() / ".cache" / "dist_ckpt")


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def local_copy(url: str, storage_options: Optional[Mapping[str, Any]] = None, refresh: bool = False) -> Path:
    """A local directory holding the checkpoint at ``url`` (downloaded once per machine;
    ``refresh``: downloaded again even if cached, as ``validate`` does to check the store's bytes).

    If the objects of the save the pointer named vanish during the download (two commits by
    another writer meanwhile: replaced data is kept one generation), the pointer is read again,
    once, and what it names then is downloaded."""
    loc = open_location(url, storage_options)
    try:
        return _local_copy(loc, url, refresh)
    except CheckpointNotFoundError as first:
        pointer = read_pointer(loc)
        if pointer is None or not isinstance(pointer.get(POINTER_FIELD), str):
            raise
        logger.warning("%s: %s; reading the pointer again (another writer committed meanwhile?)", url, first)
        return _local_copy(loc, url, refresh)


def _refuse_root_of_checkpoints(loc: StoreLocation, objects: Dict[str, Dict[str, Any]]) -> None:
    """A prefix holding checkpoints below it (``run/iter_0000100/metadata.json``...) or
    Megatron-LM's tracker, and no checkpoint of its own, is a run root: refused before anything
    is downloaded (it could be terabytes)."""
    top = {rel for rel in objects if "/" not in rel}
    if CONFIG_FNAME in top or foreign_format_of(top) is not None or COMMON_STATE_FNAME in top:
        return
    below = sorted({rel.split("/", 1)[0] for rel in objects
                    if rel.count("/") >= 1 and rel.rsplit("/", 1)[-1] in (CONFIG_FNAME, DCP_METADATA_FNAME)})
    if below or TRACKER_FNAME in top:
        names = ", ".join(below[:5]) + (", ..." if len(below) > 5 else "")
        example = loc.child_url(below[-1]) if below else f"{loc.url}/iter_XXXXXXX"
        raise CheckpointNotFoundError(f"{loc.url} is not a checkpoint but a root of checkpoints "
                                      f"({names or TRACKER_FNAME}); load one of them, e.g. {example}; nothing was "
                                      f"downloaded")


def _local_copy(loc: StoreLocation, url: str, refresh: bool) -> Path:
    pointer = read_pointer(loc)
    if pointer is not None and isinstance(pointer.get(POINTER_FIELD), str):
        name = pointer[POINTER_FIELD]
        if not name.startswith(SAVE_DIR_PREFIX) or "/" in name:
            raise CheckpointingException(f"{loc.child_url(CONFIG_FNAME)} names {name!r}, not a save directory")
        prefix = loc.child(name)
        objects = listing(loc, prefix, skip_save_dirs=False)
        if CONFIG_FNAME not in objects:
            raise CheckpointNotFoundError(f"{loc.child_url(name)}: the save {CONFIG_FNAME} names is missing its "
                                          f"objects (deleted by hand?)")
        key = name
    else:
        prefix = loc.path
        objects = listing(loc, prefix, skip_save_dirs=True)
        _refuse_root_of_checkpoints(loc, objects)
        digest = hashlib.sha256(json.dumps(sorted(
            (rel, info.get("size"), str(info.get("ETag") or info.get("etag") or info.get("mtime") or ""))
            for rel, info in objects.items()
        )).encode()).hexdigest()[:20]
        key = f"listing-{digest}"
    if not objects:
        raise CheckpointNotFoundError(f"{url}: no checkpoint there (no objects under this prefix)")
    url_dir = cache_root() / hashlib.sha256(loc.url.encode()).hexdigest()[:16]
    target = url_dir / key
    if target.is_dir() and not refresh:
        return target
    with _file_lock(url_dir / ".lock"):
        if refresh:
            shutil.rmtree(target, ignore_errors=True)
        if target.is_dir():  # another rank of this machine downloaded it meanwhile
            return target
        for stale in url_dir.glob(".partial-*"):  # under the lock: left by a download that was killed
            shutil.rmtree(stale, ignore_errors=True)
        partial = url_dir / f".partial-{key}-{uuid.uuid4().hex[:8]}"
        try:
            remote = [f"{prefix}/{rel}" for rel in objects]
            local = [str(partial / rel) for rel in objects]
            for path in local:
                Path(path).parent.mkdir(parents=True, exist_ok=True)
            loc.call(f"downloading {len(remote)} objects", "get", remote, local,
                     nbytes=sum(int(info.get("size") or 0) for info in objects.values()))
            os.rename(partial, target)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        (url_dir / "url").write_text(loc.url)
        _prune_cache(url_dir, keep=target)
    logger.info("%s: %d objects cached in %s", url, len(objects), target)
    return target


def _prune_cache(url_dir: Path, keep: Path, copies: int = 2) -> None:
    """Keep the newest ``copies`` cached versions of one URL (the current one among them)."""
    versions = sorted((p for p in url_dir.iterdir() if p.is_dir() and not p.name.startswith(".")),
                      key=lambda p: p.stat().st_mtime, reverse=True)
    for old in [v for v in versions if v != keep][copies - 1:]:
        shutil.rmtree(old, ignore_errors=True)


def localize(path: PathOrUrl, storage_options: Optional[Mapping[str, Any]] = None) -> Path:
    """A local path for a checkpoint given as a path or a URL (loads: downloaded, cached).
    ``storage_options`` apply to URLs; with a local path they are not used (a call may take a
    local source and a URL target with one set of options)."""
    if is_url(path):
        return local_copy(str(path), storage_options)
    return local_path(path)

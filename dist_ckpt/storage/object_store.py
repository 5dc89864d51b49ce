"""Checkpoints at fsspec URLs (``s3://bucket/prefix``, ``gs://``, ``memory://``, ...).

Object stores have no rename, so a save cannot be staged beside its target and renamed onto
it. Layout of a checkpoint saved by dist_ckpt at URL ``U``::

    U/dist_ckpt-save-<id>/     one complete checkpoint directory per save (metadata.json,
                               common.pt, .metadata, *.distcp or zarr arrays, the manifest)
    U/metadata.json            the commit point: the current save's config plus
                               "dist_ckpt_data": "dist_ckpt-save-<id>"

A save writes into a local scratch directory (``DIST_CKPT_SCRATCH``, default the system's
temporary directory; the same path on every rank), every rank uploads the files it wrote to
``U/dist_ckpt-save-<id>/``, and only when all have, the coordinator PUTs ``U/metadata.json``:
one PUT, which readers see whole or not at all. A save killed before that PUT leaves
``U/metadata.json`` naming the previous save, whose objects are untouched; one killed after it
leaves the new one.

Two writers, and readers, racing one URL:

* the pointer PUT is conditional (S3 conditional writes: ``If-Match`` on the ETag the pointer had
  when the save began, ``If-None-Match: *`` when there was none): of two saves racing, exactly
  one commits; the other gets ``ConcurrentSaveError`` and removes its own objects. Stores
  without conditional writes (any fsspec protocol other than S3) get a lock object
  ``U/dist_ckpt-writer.json`` instead, checked and written when a save begins: it narrows the
  race but cannot close it (a check and a write are two requests) - one writer per URL there;
* what a commit replaces is deleted one generation later: after save N commits, the save
  directories other than N and the one N replaced (named in the pointer as
  ``dist_ckpt_previous``) go, and never one younger than ``SAVE_GRACE_S`` (its save may still
  be uploading), so a reader that read the previous pointer finishes its download;
* a load whose objects vanished while it downloaded (two commits happened meanwhile) reads the
  pointer again, once, and loads what it names then.

Objects of an interrupted save are removed by a later save to ``U`` or by ``dist-ckpt clean U``
once older than the grace period. Checkpoint files at ``U``'s root (a plain directory upload
the first save replaced) are removed right after that commit.

A load copies the objects of the save ``U/metadata.json`` names into a local cache once per
machine (``DIST_CKPT_CACHE``, default ``~/.cache/dist_ckpt``; ranks of one machine share it,
the first downloads under a file lock), then reads it as a local directory; a save directory
never changes, so a cached copy is reused until the pointer moves. Checkpoints uploaded as
plain directories (``aws s3 cp -r``) and foreign formats (PyTorch DCP, safetensors) are read
too, cached under a digest of their object listing (names, sizes, ETags).

For S3 the endpoint and credentials come from ``storage_options`` (passed to fsspec/s3fs) or
the standard AWS variables (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...). Requests are
retried a bounded number of times (``DEFAULT_S3_OPTIONS``); then a ``StorageError`` names the
URL.

Every storage call has a deadline (``StoreLocation.call``): a server that accepts connections
but never answers (a network partition, a stopped server) fails the call after
``DEFAULT_DEADLINE_S`` (60 s; ``storage_options={"dist_ckpt_deadline_s": ...}`` or the variable
``DIST_CKPT_STORAGE_DEADLINE_S``), plus the time a transfer needs at ``MIN_TRANSFER_RATE``,
with a ``StorageError`` naming the URL - not after botocore's read timeout times its attempts
times s3fs's retries (more than 6 minutes). The deadline cancels the request (fsspec's
asynchronous filesystems: s3fs, gcsfs, ...); filesystems without an asynchronous
implementation have only their own timeouts.
"""

from __future__ import annotations

import calendar
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Union

from ..core import (
    CONFIG_FNAME,
    CheckpointExistsError,
    CheckpointingConfig,
    CheckpointingException,
    CheckpointNotFoundError,
    config_bytes,
    maybe_load_config,
)
from ..runtime.interrupts import interrupts_deferred
from .entries import checkpoint_entries_of
from .formats import describe_foreign, foreign_format_of
from .leftovers import OVERWRITE_HINT
from .locations import TRACKER_FNAME
from .lock import ConcurrentSaveError

logger = logging.getLogger(__name__)

__all__ = [
    "StorageError",
    "DEFAULT_S3_OPTIONS",
    "DEFAULT_DEADLINE_S",
    "DEADLINE_OPTION",
    "DEADLINE_ENV",
    "SAVE_DIR_PREFIX",
    "POINTER_FIELD",
    "PREVIOUS_FIELD",
    "SAVE_GRACE_S",
    "is_url",
    "StoreLocation",
    "open_location",
    "local_copy",
    "localize",
    "RemoteSave",
    "WriteThenUpload",
    "written_files",
    "begin_remote_save",
    "clean_url",
    "files_owned",
    "scratch_listing",
    "publish_checkpoint",
    "upload_files",
    "require_empty_prefix",
    "new_scratch_dir",
]

SAVE_DIR_PREFIX = "dist_ckpt-save-"
POINTER_FIELD = "dist_ckpt_data"
PREVIOUS_FIELD = "dist_ckpt_previous"  # the save the pointer's save replaced: kept one generation more
WRITER_LOCK = "dist_ckpt-writer.json"  # stores without conditional writes: who is saving (best effort)
#: a save directory younger than this is never removed by another save's cleanup: a save that
#: began after that cleanup's commit (so its conditional commit can still win) may be uploading
#: its first objects while the cleanup lists. Minutes cover that window and clock skew between
#: machines; a URL re-saved more often than this keeps the directories of those saves until they
#: are older. DIST_CKPT_SAVE_GRACE_S overrides it.
SAVE_GRACE_S = 900.0
_SAVE_TIME = re.compile(rf"^{SAVE_DIR_PREFIX}(\d{{8}}T\d{{6}})-")
_CONDITIONAL_PROTOCOLS = ("s3", "s3a")
# Bounded retries and timeouts: a refusing or unreachable endpoint ends in an error within
# seconds, not a hang (s3fs itself retries a call 5 times, ~2 s of back-off in all; botocore
# would add up to 5 attempts of its own to each).
DEFAULT_S3_OPTIONS: Dict[str, Any] = {
    "config_kwargs": {"connect_timeout": 5, "read_timeout": 20, "retries": {"max_attempts": 2, "mode": "standard"}},
}
DEFAULT_DEADLINE_S = 60.0  # a storage call that has not answered by then fails (module docstring)
DEADLINE_OPTION = "dist_ckpt_deadline_s"  # in storage_options (not passed on to fsspec)
DEADLINE_ENV = "DIST_CKPT_STORAGE_DEADLINE_S"
MIN_TRANSFER_RATE = 8 * 2**20  # bytes/s: a transfer of n bytes gets n / this more time
PathOrUrl = Union[str, os.PathLike]


class StorageError(CheckpointingException, OSError):
    """A URL's storage refused or failed a request (after the bounded retries)."""


class _PreconditionFailed(StorageError):
    """A conditional write found the object changed (another writer committed)."""


def is_url(path: Any) -> bool:
    """True for ``proto://...`` strings other than ``file://`` (those are local paths)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def _local_path(path: PathOrUrl) -> Path:
    text = os.fspath(path)
    return Path(text[len("file://"):] if isinstance(text, str) and text.startswith("file://") else text)


@contextlib.contextmanager
def _storage_errors(url: str, doing: str, deadline_s: Optional[float] = None) -> Iterator[None]:
    """Every failure of a storage call as one of our errors, naming the URL."""
    try:
        yield
    except CheckpointingException:
        raise
    except OSError as e:
        if "pre-condition" in str(e) or "PreconditionFailed" in str(e):
            raise _PreconditionFailed(f"{url}: {doing}: the object changed since it was read ({e})") from None
        if isinstance(e, TimeoutError):  # fsspec's FSTimeoutError (our deadline), or the client's own
            within = f"within {deadline_s:.0f} s" if deadline_s is not None else "in time"
            raise StorageError(f"{url}: {doing} got no answer {within} ({type(e).__name__}); the storage is stalled "
                               f"or unreachable (the deadline: storage_options={{'{DEADLINE_OPTION}': seconds}} or "
                               f"{DEADLINE_ENV})") from None
        if isinstance(e, FileNotFoundError):
            raise CheckpointNotFoundError(f"{url}: {doing} failed, not found ({e})") from None
        raise StorageError(f"{url}: {doing} failed ({type(e).__name__}: {e}); check the endpoint, "
                           f"credentials and bucket (storage_options= or AWS_* variables)") from None
    except (ValueError, RuntimeError) as e:
        raise StorageError(f"{url}: {doing} failed ({type(e).__name__}: {e}); check the endpoint, "
                           f"credentials and bucket (storage_options= or AWS_* variables)") from None
    except Exception as e:  # botocore/aiohttp errors that are not OSErrors
        if type(e).__module__.split(".")[0] in {"botocore", "aiobotocore", "aiohttp", "s3fs", "fsspec", "gcsfs"}:
            raise StorageError(f"{url}: {doing} failed ({type(e).__name__}: {e})") from None
        raise


@dataclass
class StoreLocation:
    """A URL resolved to an fsspec filesystem and the path inside it."""

    url: str
    fs: Any
    path: str
    storage_options: Dict[str, Any] = field(default_factory=dict)
    deadline_s: float = DEFAULT_DEADLINE_S

    def call(self, doing: str, method: str, *args: Any, nbytes: int = 0, **kwargs: Any) -> Any:
        """``fs.<method>(*args, **kwargs)`` within the deadline (plus ``nbytes`` at
        ``MIN_TRANSFER_RATE``), failures as ``StorageError``/``CheckpointNotFoundError`` naming
        ``doing`` and the URL."""
        deadline = self.deadline_s + nbytes / MIN_TRANSFER_RATE
        with _storage_errors(self.url, doing, deadline):
            if getattr(self.fs, "async_impl", False):  # fsspec's sync wrapper cancels the request at ``timeout``
                kwargs["timeout"] = deadline
            return getattr(self.fs, method)(*args, **kwargs)

    def child(self, name: str) -> str:
        return f"{self.path.rstrip('/')}/{name}"

    def child_url(self, name: str) -> str:
        return f"{self.url.rstrip('/')}/{name}"


def open_location(url: str, storage_options: Optional[Mapping[str, Any]] = None) -> StoreLocation:
    """The filesystem for ``url`` (fsspec), with bounded retries for S3 unless overridden."""
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with the s3 extra
        raise CheckpointingException(f"{url}: URLs need fsspec; install dist_ckpt[s3]") from None
    protocol = url.split("://", 1)[0]
    deadline = _deadline_of(url, storage_options)
    options: Dict[str, Any] = {}
    if protocol in ("s3", "s3a"):
        # a fresh client per location: a cached one would keep the AWS_* variables of its creation
        options = {"skip_instance_cache": True, **json.loads(json.dumps(DEFAULT_S3_OPTIONS))}
        options["config_kwargs"].update((storage_options or {}).get("config_kwargs", {}))
    options.update({k: v for k, v in (storage_options or {}).items() if k not in ("config_kwargs", DEADLINE_OPTION)})
    try:
        fs, path = fsspec.core.url_to_fs(url, **options)
    except ImportError as e:
        raise CheckpointingException(f"{url}: no filesystem for {protocol}:// ({e}); for S3 install dist_ckpt[s3]") from None
    fs.invalidate_cache()  # other protocols share instances and their listings; another process may have written
    return StoreLocation(url.rstrip("/"), fs, path.rstrip("/"), dict(storage_options or {}), deadline)


def _deadline_of(url: str, storage_options: Optional[Mapping[str, Any]]) -> float:
    raw = (storage_options or {}).get(DEADLINE_OPTION, os.environ.get(DEADLINE_ENV) or DEFAULT_DEADLINE_S)
    try:
        deadline = float(raw)
    except (TypeError, ValueError):
        deadline = -1.0
    if not deadline > 0:
        raise CheckpointingException(f"{url}: the storage deadline ({DEADLINE_OPTION} / {DEADLINE_ENV}) must be a "
                                     f"positive number of seconds, got {raw!r}")
    return deadline


def _pointer_etag(loc: StoreLocation) -> Optional[str]:
    """The pointer's ETag now (None: no pointer), for the conditional commit."""
    loc.fs.invalidate_cache(loc.path)
    try:
        info = loc.call(f"reading {CONFIG_FNAME}'s ETag", "info", loc.child(CONFIG_FNAME))
    except CheckpointNotFoundError:
        return None
    etag = info.get("ETag") or info.get("etag")
    return str(etag) if etag else None


def _read_pointer(loc: StoreLocation) -> Optional[Dict[str, Any]]:
    """``U/metadata.json`` as a dict, or None when there is none."""
    try:
        raw = loc.call(f"reading {CONFIG_FNAME}", "cat_file", loc.child(CONFIG_FNAME))
    except CheckpointNotFoundError:
        return None
    try:
        content = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointingException(f"{loc.child_url(CONFIG_FNAME)} is not valid JSON ({e})") from None
    return content if isinstance(content, dict) else None


def _listing(loc: StoreLocation, prefix: str, skip_save_dirs: bool) -> Dict[str, Dict[str, Any]]:
    """Objects under ``prefix``: relative name -> info (size, ETag)."""
    try:
        found = loc.call("listing objects", "find", prefix, detail=True)
    except CheckpointNotFoundError:
        found = {}
    out: Dict[str, Dict[str, Any]] = {}
    for full, info in found.items():
        if info.get("type") == "directory":
            continue
        rel = full[len(prefix):].lstrip("/")
        parts = rel.split("/")
        if not rel or ".." in parts or "" in parts:
            raise CheckpointingException(f"{loc.url}: refusing the object name {full!r}")
        if skip_save_dirs and parts[0].startswith(SAVE_DIR_PREFIX):
            continue
        out[rel] = info
    return out


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


def _cache_root() -> Path:
    return Path(os.environ.get("DIST_CKPT_CACHE") or Path.home() / ".cache" / "dist_ckpt")


def _scratch_root() -> Path:
    return Path(os.environ.get("DIST_CKPT_SCRATCH") or tempfile.gettempdir()) / "dist_ckpt-scratch"


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
        pointer = _read_pointer(loc)
        if pointer is None or not isinstance(pointer.get(POINTER_FIELD), str):
            raise
        logger.warning("%s: %s; reading the pointer again (another writer committed meanwhile?)", url, first)
        return _local_copy(loc, url, refresh)


def _refuse_root_of_checkpoints(loc: StoreLocation, objects: Dict[str, Dict[str, Any]]) -> None:
    """A prefix holding checkpoints below it (``run/iter_0000100/metadata.json``...) or
    Megatron-LM's tracker, and no checkpoint of its own, is a run root: refused before anything
    is downloaded (it could be terabytes)."""
    top = {rel for rel in objects if "/" not in rel}
    if CONFIG_FNAME in top or foreign_format_of(top) is not None or "common.pt" in top:
        return
    below = sorted({rel.split("/", 1)[0] for rel in objects
                    if rel.count("/") >= 1 and rel.rsplit("/", 1)[-1] in (CONFIG_FNAME, ".metadata")})
    if below or TRACKER_FNAME in top:
        names = ", ".join(below[:5]) + (", ..." if len(below) > 5 else "")
        example = loc.child_url(below[-1]) if below else f"{loc.url}/iter_XXXXXXX"
        raise CheckpointNotFoundError(f"{loc.url} is not a checkpoint but a root of checkpoints "
                                      f"({names or TRACKER_FNAME}); load one of them, e.g. {example}; nothing was "
                                      f"downloaded")


def _local_copy(loc: StoreLocation, url: str, refresh: bool) -> Path:
    pointer = _read_pointer(loc)
    if pointer is not None and isinstance(pointer.get(POINTER_FIELD), str):
        name = pointer[POINTER_FIELD]
        if not name.startswith(SAVE_DIR_PREFIX) or "/" in name:
            raise CheckpointingException(f"{loc.child_url(CONFIG_FNAME)} names {name!r}, not a save directory")
        prefix = loc.child(name)
        objects = _listing(loc, prefix, skip_save_dirs=False)
        if CONFIG_FNAME not in objects:
            raise CheckpointNotFoundError(f"{loc.child_url(name)}: the save {CONFIG_FNAME} names is missing its "
                                          f"objects (deleted by hand?)")
        key = name
    else:
        prefix = loc.path
        objects = _listing(loc, prefix, skip_save_dirs=True)
        _refuse_root_of_checkpoints(loc, objects)
        digest = hashlib.sha256(json.dumps(sorted(
            (rel, info.get("size"), str(info.get("ETag") or info.get("etag") or info.get("mtime") or ""))
            for rel, info in objects.items()
        )).encode()).hexdigest()[:20]
        key = f"listing-{digest}"
    if not objects:
        raise CheckpointNotFoundError(f"{url}: no checkpoint there (no objects under this prefix)")
    url_dir = _cache_root() / hashlib.sha256(loc.url.encode()).hexdigest()[:16]
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
    return _local_path(path)


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
        return _scratch_root() / self.save_name

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
        conditional = loc.url.split("://", 1)[0] in _CONDITIONAL_PROTOCOLS
        # (with a conditional PUT, the condition itself refuses a pointer written meanwhile)
        before = None if conditional else _read_pointer(loc)
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
            except _PreconditionFailed:
                raise ConcurrentSaveError(
                    f"another writer committed a checkpoint at {self.url} while this save ran; this save was not "
                    f"committed and its objects are removed (the other checkpoint is intact; one writer per URL)"
                ) from None
            self.committed = True
        self._release_writer_lock(loc)
        _remove_replaced(loc, keep={self.save_name, self.previous_save or ""})

    def _release_writer_lock(self, loc: StoreLocation) -> None:
        if loc.url.split("://", 1)[0] in _CONDITIONAL_PROTOCOLS:
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


def upload_files(local: Path, url: str, storage_options: Optional[Mapping[str, Any]], last: Sequence[str]) -> None:
    """A directory of plain files (an export) to an empty ``url``, the names ``last`` after the
    others (the index of a safetensors export, which readers follow)."""
    loc = require_empty_prefix(url, storage_options)
    names = sorted(scratch_listing(local))
    _put(loc, local, [n for n in names if n not in last])
    _put(loc, local, [n for n in names if n in last])


def require_empty_prefix(url: str, storage_options: Optional[Mapping[str, Any]]) -> StoreLocation:
    """Refuse a target prefix that holds objects (checked before an export starts, and again
    before its upload)."""
    loc = open_location(url, storage_options)
    if _listing(loc, loc.path, skip_save_dirs=False):
        raise CheckpointExistsError(f"{url} holds objects already; export to a new prefix")
    return loc


def new_scratch_dir(what: str) -> Path:
    """A fresh local directory for a one-process job that ends in an upload."""
    path = _scratch_root() / f"{what}-{uuid.uuid4().hex[:12]}"
    path.mkdir(parents=True)
    return path


def _remove_replaced(loc: StoreLocation, keep: Set[str]) -> List[str]:
    """After the commit: other save directories (but ``keep``: the new one and the one it
    replaced, and young ones) and a replaced plain checkpoint's files."""
    loc.fs.invalidate_cache(loc.path)
    removed = _remove_interrupted(loc, keep)
    root_files = {rel for rel in _listing(loc, loc.path, skip_save_dirs=True) if rel != CONFIG_FNAME}
    entries = checkpoint_entries_of(root_files)  # a replaced checkpoint uploaded as a plain directory
    stale = sorted(rel for rel in root_files if rel.split("/", 1)[0] in entries)
    if stale:
        loc.call("removing the replaced checkpoint's files", "rm", [loc.child(n) for n in stale])
        removed.extend(stale)
    return removed


def begin_remote_save(url: str, overwrite: Optional[bool], storage_options: Optional[Mapping[str, Any]]) -> RemoteSave:
    """Coordinator: check the target, note the pointer (the commit's condition), pick the save id."""
    loc = open_location(url, storage_options)
    etag = _pointer_etag(loc)
    pointer = _read_pointer(loc)
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
        foreign = foreign_format_of([r for r in _listing(loc, loc.path, skip_save_dirs=True) if "/" not in r])
        if foreign is not None and overwrite is not True:
            raise CheckpointExistsError(
                f"{url} holds a {describe_foreign(foreign)} written by another tool (not a dist_ckpt save); nothing "
                f"was written. Save to another URL, or pass overwrite=True to replace it (its files of other "
                f"formats are kept)")
        _remove_interrupted(loc, keep=set())
    current = pointer.get(POINTER_FIELD) if pointer else None
    remote = RemoteSave(loc.url, _new_save_name(), dict(storage_options or {}), overwrite, pointer_etag=etag,
                        previous_save=current if isinstance(current, str) else None)
    if loc.url.split("://", 1)[0] not in _CONDITIONAL_PROTOCOLS:
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
    pointer = _read_pointer(loc)
    if pointer is None and not _listing(loc, loc.path, skip_save_dirs=False):
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


"""A URL as a store: one fsspec filesystem and path, every call under a deadline, our errors.

``StoreLocation.call`` is the only way the other object-store modules talk to a store: a server
that accepts connections but never answers fails the call after ``DEFAULT_DEADLINE_S`` (plus the
time a transfer needs at ``MIN_TRANSFER_RATE``) with a ``StorageError`` naming the URL. Also the
names of the layout (``SAVE_DIR_PREFIX``, the pointer's fields) and the pointer's reading.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional, Union

from ...core import CONFIG_FNAME, CheckpointingException, CheckpointNotFoundError

__all__ = [
    "StorageError",
    "PreconditionFailed",
    "DEFAULT_S3_OPTIONS",
    "DEFAULT_DEADLINE_S",
    "DEADLINE_OPTION",
    "DEADLINE_ENV",
    "MIN_TRANSFER_RATE",
    "SAVE_DIR_PREFIX",
    "POINTER_FIELD",
    "PREVIOUS_FIELD",
    "WRITER_LOCK",
    "CONDITIONAL_PROTOCOLS",
    "StoreLocation",
    "open_location",
    "is_url",
    "local_path",
    "read_pointer",
    "pointer_etag",
    "listing",
]


SAVE_DIR_PREFIX = "dist_ckpt-save-"
POINTER_FIELD = "dist_ckpt_data"
PREVIOUS_FIELD = "dist_ckpt_previous"  # the save the pointer's save replaced: kept one generation more
WRITER_LOCK = "dist_ckpt-writer.json"  # stores without conditional writes: who is saving (best effort)
CONDITIONAL_PROTOCOLS = ("s3", "s3a")
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


class PreconditionFailed(StorageError):
    """A conditional write found the object changed (another writer committed)."""


def is_url(path: Any) -> bool:
    """True for ``proto://...`` strings other than ``file://`` (those are local paths)."""
    return isinstance(path, str) and "://" in path and not path.startswith("file://")


def local_path(path: PathOrUrl) -> Path:
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
            raise PreconditionFailed(f"{url}: {doing}: the object changed since it was read ({e})") from None
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


def pointer_etag(loc: StoreLocation) -> Optional[str]:
    """The pointer's ETag now (None: no pointer), for the conditional commit."""
    loc.fs.invalidate_cache(loc.path)
    try:
        info = loc.call(f"reading {CONFIG_FNAME}'s ETag", "info", loc.child(CONFIG_FNAME))
    except CheckpointNotFoundError:
        return None
    etag = info.get("ETag") or info.get("etag")
    return str(etag) if etag else None


def read_pointer(loc: StoreLocation) -> Optional[Dict[str, Any]]:
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


def listing(loc: StoreLocation, prefix: str, skip_save_dirs: bool) -> Dict[str, Dict[str, Any]]:
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

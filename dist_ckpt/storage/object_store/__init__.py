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
* an export (plain files, no pointer) claims its empty prefix with ``dist_ckpt-export.json``
  (created only if absent) while it uploads, so a second export racing to it is refused before
  it uploads any shard over the first one's;
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

from .destinations import destination_of, forget_destination, note_written_at_destination, register_destination
from .download import cache_root, local_copy, localize
from .store import (
    DEADLINE_ENV,
    DEADLINE_OPTION,
    DEFAULT_DEADLINE_S,
    DEFAULT_S3_OPTIONS,
    POINTER_FIELD,
    PREVIOUS_FIELD,
    SAVE_DIR_PREFIX,
    StorageError,
    StoreLocation,
    is_url,
    open_location,
)
from .upload import (
    SAVE_GRACE_S,
    RemoteSave,
    WriteThenUpload,
    begin_remote_save,
    clean_url,
    files_owned,
    new_scratch_dir,
    publish_checkpoint,
    require_empty_prefix,
    scratch_listing,
    upload_files,
    written_files,
)

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
    "cache_root",
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
    "register_destination",
    "destination_of",
    "note_written_at_destination",
    "forget_destination",
]

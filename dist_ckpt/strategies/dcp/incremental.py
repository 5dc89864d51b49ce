"""Incremental ``torch_dist`` saves: items whose bytes equal the same item's in a base checkpoint
are not written again; the new checkpoint references the base's bytes through a hard link of the
base's data file, and stays a complete, ordinary DCP checkpoint.

Why hard links: a checkpoint must stay loadable after its base is deleted (retention keeps the
newest few; `dist-ckpt clean` removes the rest). A hard link is a second name of the same file, so
deleting the base removes its name and leaves the bytes to the checkpoints that link them; no
deleter has to know which checkpoints depend on which. The files keep their names, so readers
that know nothing of this (torch's ``FileSystemReader``, Megatron-Core) read them as any other
data file.

The decision: each tensor item's dtype, shape and bytes are hashed with xxh3-128 before it
would be written (``content_digest``); an item is referenced
when the base stored an item at the same key and chunk offset, with the same global size,
dtype, stream transforms and 128-bit digest (``ContentLog`` records them in each save's
``__<rank>_..._content.json``, covered by the manifest). Everything else is written as usual.

The references carry the base's manifest entries, so validation and loads verify the linked bytes
as they verify written ones: a base byte damaged after the save is found when the new checkpoint
is read.

Where hard links cannot be made (another file system, some FUSE and object-store mounts) the
item is written in full, and the log says so once per save. A base whose index, manifest or
content records do not verify is not used: the save is a full one (logged).

Content records of version 2 carry each item's global size, dtype and transforms, so a base is
indexed from its manifest and content records alone: unpickling the base's ``.metadata`` took
20 ms of every 1 GiB incremental save (2,168 items), about as long as the rest of the base's
index. Version 1 records (dist_ckpt 0.2.0) hold only the digests: such a base is indexed with
its ``.metadata`` as before.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import xxhash
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import WriteItem
from torch.distributed.checkpoint.storage import WriteResult

from ...core import CheckpointingException
from ...integrity.manifest import Manifest, ManifestEntry, Recorder, load_manifest, verify_bytes
from ...runtime.durable import atomic_write_bytes
from .record import tensor_bytes

__all__ = ["CONTENT_SUFFIX", "content_digest", "ContentLog", "BaseIndex", "Reuse", "ReuseStats"]

logger = logging.getLogger(__name__)

CONTENT_SUFFIX = "_content.json"
CONTENT_FORMAT = "dist_ckpt_content"
CONTENT_VERSION = 2  # rows: file, offset, key, chunk offset, digest, global size, dtype, transforms
CONTENT_VERSIONS_READ = (1, 2)  # version 1 rows end at the digest (the base's .metadata has the rest)
CONTENT_HASH = "xxh3_128"


def content_digest(tensor: torch.Tensor) -> str:
    """The xxh3-128 hex digest of ``tensor``'s dtype, shape and bytes (contiguous, host memory):
    equal digests mean records that load as the same tensor, whatever the zip CRC setting of
    the save that wrote them."""
    hasher = xxhash.xxh3_128(f"{tensor.dtype}{tuple(tensor.shape)}".encode())
    if tensor.numel():
        hasher.update(tensor_bytes(tensor))
    return hasher.hexdigest()


class ContentLog:
    """One job's content records: each tensor item's digest and layout, with the (file, offset)
    it is stored at; written as one JSON file beside the data files, recorded in the manifest
    like them."""

    def __init__(self) -> None:
        self._rows: List[List[Any]] = []
        self._lock = threading.Lock()

    def add(self, file: str, offset: int, item: WriteItem, digest: str, descriptors: Sequence[str]) -> None:
        data = item.tensor_data
        if data is None:  # pragma: no cover - only tensor items are hashed
            raise CheckpointingException(f"internal error: content record of a bytes item {item.index.fqn!r}")
        row = [file, offset, item.index.fqn, list(item.index.offset or ()), digest, list(data.size),
               str(data.properties.dtype), list(descriptors)]
        with self._lock:
            self._rows.append(row)

    def write(self, checkpoint_dir: Path, name: str, recorder: Recorder) -> None:
        rows = sorted(self._rows, key=lambda r: (r[0], r[1]))
        content = json.dumps({"format": CONTENT_FORMAT, "version": CONTENT_VERSION, "hash": CONTENT_HASH,
                              "items": rows}).encode()
        atomic_write_bytes(Path(checkpoint_dir) / name, content)
        recorder.add_bytes(name, content)


class BaseItem(NamedTuple):
    """A stored tensor item of the base checkpoint."""

    info: Any  # its _StorageInfo (file, offset, length, transform descriptors); a reference shares it
    digest: str  # xxh3-128 of its record
    size: Tuple[int, ...]  # the global tensor's size
    dtype: str  # str() of its torch dtype
    descriptors: Tuple[str, ...]  # its stream transforms (``info.transform_descriptors``)


ItemKey = Tuple[str, Tuple[int, ...]]  # (key, chunk offset)


@dataclass
class BaseIndex:
    """What an incremental save needs of its base: its items by (key, chunk offset), and each
    data file's identity when it was read (a file replaced since is not linked)."""

    directory: str
    items: Dict[Tuple[str, Tuple[int, ...]], BaseItem]
    stamps: Dict[str, Tuple[int, int, int]] = field(default_factory=dict)  # file -> (inode, size, mtime_ns)
    # file -> the manifest entries of every item in it: a linked file's bytes are all verified
    # in the new checkpoint, the items it does not reference included
    file_entries: Dict[str, List[ManifestEntry]] = field(default_factory=dict)

    @classmethod
    def load(cls, base_dir: Any, wanted: Sequence[MetadataIndex], read_metadata: Callable[[], Metadata]
             ) -> Optional["BaseIndex"]:
        """The index of ``base_dir`` for the items ``wanted`` (the tensor items this rank saves:
        a rank looks up its own items instead of indexing every rank's), or None (logged) when
        it cannot serve as a base: no manifest, a manifest that does not verify, no content
        records (saved without content hashes), or records that do not verify against the
        manifest. ``read_metadata``: the base's ``.metadata``, read and checked, needed only for
        version 1 records."""
        base = Path(base_dir)
        manifest = load_manifest(base)
        if manifest is None or manifest.damaged:
            logger.warning("incremental save: base %s has %s; saving in full", base,
                           "no manifest" if manifest is None else "a damaged manifest")
            return None
        records = sorted(p for p in base.iterdir() if p.name.endswith(CONTENT_SUFFIX))
        if not records:
            logger.warning("incremental save: base %s has no content records (it was not saved with content "
                           "hashes); saving in full", base)
            return None
        rows: Dict[ItemKey, List[Any]] = {}  # version 2
        digests: Dict[Tuple[str, int], str] = {}  # version 1: by where the item is stored
        items: Dict[ItemKey, BaseItem] = {}
        try:
            for record in records:
                raw = record.read_bytes()
                verify_bytes(base, record.name, 0, raw, what="the content record")
                content = json.loads(raw)
                version = content.get("version")
                if (content.get("format"), content.get("hash")) != (CONTENT_FORMAT, CONTENT_HASH) or (
                        version not in CONTENT_VERSIONS_READ):
                    raise ValueError(f"{record.name}: unknown format {content.get('format')!r} {version!r}")
                if version == 1:
                    for file, offset, _fqn, _chunk, digest in content["items"]:
                        digests[(str(file), int(offset))] = str(digest)
                else:
                    for row in content["items"]:
                        rows[(row[2], tuple(row[3]))] = row
            for index in wanted:
                key = (index.fqn, tuple(index.offset or ()))
                row = rows.get(key)
                if row is not None:
                    file, offset, _fqn, _chunk, digest, size, dtype, descriptors = row
                    entry = manifest.entries.get((file, offset))
                    if entry is not None:  # the manifest names only files in the checkpoint itself
                        info = _StorageInfo(file, offset, entry.length, list(descriptors) or None)
                        items[key] = BaseItem(info, str(digest), tuple(size), str(dtype), tuple(descriptors))
            if digests:
                items.update(_items_of_version_1(read_metadata(), manifest, digests, wanted, items))
        except (OSError, ValueError, KeyError, TypeError, CheckpointingException) as e:
            logger.warning("incremental save: base %s: its content records do not verify (%s); saving in full",
                           base, e)
            return None
        stamps: Dict[str, Tuple[int, int, int]] = {}
        for name in {item.info.relative_path for item in items.values()}:
            try:
                st = os.stat(base / name)
            except OSError:
                continue  # gone already: its items are written in full
            stamps[name] = (st.st_ino, st.st_size, st.st_mtime_ns)
        return cls(str(base), items, stamps, {name: list(manifest.files.get(name, ())) for name in stamps})


def _items_of_version_1(metadata: Metadata, manifest: Manifest, digests: Dict[Tuple[str, int], str],
                        wanted: Sequence[MetadataIndex], found: Dict[ItemKey, BaseItem]) -> Dict[ItemKey, BaseItem]:
    """The ``wanted`` items not ``found`` in version 2 records, from a base with version 1
    records (digests by where each item is stored): their layout from the base's ``.metadata``."""
    items: Dict[ItemKey, BaseItem] = {}
    for index in wanted:
        key = (index.fqn, tuple(index.offset or ()))
        info = metadata.storage_data.get(index)
        md = metadata.state_dict_metadata.get(index.fqn)
        if key in found or info is None or not isinstance(md, TensorStorageMetadata):
            continue
        digest = digests.get((info.relative_path, info.offset))
        entry = manifest.entries.get((info.relative_path, info.offset))
        if digest is None or entry is None or entry.length != info.length:
            continue
        items[key] = BaseItem(info, digest, tuple(md.size), str(md.properties.dtype),
                              tuple(info.transform_descriptors or ()))
    return items


@dataclass
class ReuseStats:
    """What one rank's incremental save referenced and wrote (``TorchDistSaveShardedStrategy.last_reuse``)."""

    referenced_items: int = 0
    referenced_bytes: int = 0
    written_items: int = 0
    links: int = 0
    links_unavailable: Optional[str] = None  # why hard links could not be made (items written in full)

    @staticmethod
    def total(first: Optional["ReuseStats"], second: Optional["ReuseStats"]) -> Optional["ReuseStats"]:
        """The reuse of a save's two write jobs (what was written at once, and in the background)."""
        if first is None or second is None:
            return first or second
        return ReuseStats(first.referenced_items + second.referenced_items,
                          first.referenced_bytes + second.referenced_bytes,
                          first.written_items + second.written_items, first.links + second.links,
                          first.links_unavailable or second.links_unavailable)


class Reuse:
    """The decisions of one write job against its base: ``reference`` links the base's file
    into the new checkpoint (once per file) and returns the item's result, or None when the item
    must be written."""

    def __init__(self, base: BaseIndex, checkpoint_dir: Path, descriptors: Sequence[str]) -> None:
        self.base = base
        self.checkpoint_dir = Path(checkpoint_dir)
        self.descriptors = tuple(descriptors)
        self.stats = ReuseStats()
        self._linked: Dict[str, bool] = {}
        self._lock = threading.Lock()

    def reference(self, item: WriteItem, digest: str, recorder: Recorder, content: ContentLog
                  ) -> Optional[WriteResult]:
        index, data = item.index, item.tensor_data
        found = self.base.items.get((index.fqn, tuple(index.offset or ())))
        if (found is None or data is None or found.digest != digest or found.size != data.size
                or found.dtype != str(data.properties.dtype) or found.descriptors != self.descriptors
                or not self._link(found.info.relative_path, recorder)):
            self.stats.written_items += 1
            return None
        info = found.info
        content.add(info.relative_path, info.offset, item, digest, found.descriptors)
        self.stats.referenced_items += 1
        self.stats.referenced_bytes += info.length
        return WriteResult(index=index, size_in_bytes=info.length, storage_data=info)

    def _link(self, name: str, recorder: Recorder) -> bool:
        """The base's ``name`` linked into the new checkpoint (or already there, the same file),
        with the manifest entries of all its items."""
        with self._lock:
            if name in self._linked:
                return self._linked[name]
            self._linked[name] = ok = self._make_link(name)
            if ok:
                for entry in self.base.file_entries.get(name, ()):
                    recorder.add_entry(entry)
            return ok

    def _make_link(self, name: str) -> bool:
        if self.stats.links_unavailable is not None:
            return False
        stamp = self.base.stamps.get(name)
        source, target = Path(self.base.directory) / name, self.checkpoint_dir / name
        if stamp is None:
            return False
        try:
            os.link(source, target)
        except FileExistsError:  # another rank of this save linked it: the same file?
            pass
        except FileNotFoundError:  # the base was deleted meanwhile: write these items
            logger.info("incremental save: %s is gone from the base; its items are written in full", source)
            return False
        except OSError as e:
            if e.errno in (errno.EXDEV, errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.EACCES):
                self.stats.links_unavailable = f"{type(e).__name__}: {e}"
                logger.warning("incremental save: cannot hard-link the base's files into %s (%s); unchanged items "
                               "are written in full", self.checkpoint_dir, e)
                return False
            raise
        st = os.stat(target)
        if (st.st_ino, st.st_size, st.st_mtime_ns) != stamp:  # not the file the base index was read from
            logger.warning("incremental save: %s changed since the base's index was read; its items are written "
                           "in full", source)
            with contextlib.suppress(FileNotFoundError):
                target.unlink()  # referenced by nothing of this save
            return False
        self.stats.links += 1
        return True

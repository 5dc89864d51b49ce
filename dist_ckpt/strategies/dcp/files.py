"""File I/O of the 'torch_dist' format: writing ``.distcp`` files and ``.metadata``, reading
them back with every offset, size, name and checksum checked.

Why not DCP's ``FileSystemWriter``: it cannot hash each item as it is written, and its writer
keeps every tensor of a file alive until the file closes. The bytes written are the same: each
item is a standalone ``torch.save`` blob (bytes items verbatim) at the offset and length the
pickled ``Metadata`` records (written by ``record`` without torch.save's copies), one fsync per
file; DCP's stream transforms (compression, a user's own) are applied as torch applies them
(``transformed_stream``). Reading keeps DCP's ``FileSystemReader`` for
its stream transforms but replaces unpickling and item reads with checked versions.
"""

from __future__ import annotations

import copy
import importlib.machinery
import io
import math
import os
import sys
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Set, Tuple, Union, cast

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ...core import CheckpointNotFoundError, CheckpointingException, CorruptCheckpointError, UnsupportedFormatError
from ...integrity.manifest import HashingWriter, Recorder, hash_bytes, load_manifest, verification_enabled, verify_bytes
from ...integrity.safe_unpickle import plain_pickle_builtins, safe_pickle_load, safe_torch_load
from ...runtime.devices import CallerStreams, HostCopies, HostCopy, is_host_memory
from ...runtime.durable import atomic_write_bytes
from ...standalone.plain_files import ITEM_ALIGNMENT, WRITE_BUFFER_BYTES, each_in_a_thread
from ...runtime.file_cache import ParsedFileCache
from ...storage.writer_record import describe_writer
from .metadata import MCoreMetadata, MCoreSavePlan
from .chunk_copy import copy_region
from .read import ItemGroup, read_item_groups
from .incremental import ContentLog, Reuse, content_digest
from .plain_records import made
from .record import small_tensor_record, write_tensor_record
from .torch_releases import TensorPropertiesOfAnyRelease, portable_metadata_bytes

__all__ = [
    "DCP_METADATA_FNAME",
    "DCP_FORMAT_VERSION",
    "write_dcp_file",
    "write_dcp_files",
    "write_dcp_metadata",
    "checked_extensions",
    "transformed_stream",
    "DcpReader",
    "load_dcp_metadata_pickle",
    "newer_format_error",
]

DCP_METADATA_FNAME = ".metadata"
MAX_DCP_METADATA_BYTES = 8 << 30  # far above the index of any real model; checked with stat
DCP_FORMAT_VERSION = "1.0.0"  # what DCP (and Megatron-Core) record in Metadata.version

ItemData = Union[torch.Tensor, io.BytesIO]


def _item_nbytes(item: WriteItem) -> int:
    if item.tensor_data is None:
        return 0
    return math.prod(item.tensor_data.chunk.sizes) * item.tensor_data.properties.dtype.itemsize


def _buckets(items: List[WriteItem], count: int) -> List[List[WriteItem]]:
    """Items split into ``count`` files of similar size (bytes items spread round-robin)."""
    if count <= 1:
        return [items]
    buckets: List[List[WriteItem]] = [[] for _ in range(count)]
    sizes = [0] * count
    for i, item in enumerate(it for it in items if it.type == WriteItemType.BYTE_IO):
        buckets[i % count].append(item)
    for item in sorted((it for it in items if it.type != WriteItemType.BYTE_IO), key=_item_nbytes, reverse=True):
        smallest = sizes.index(min(sizes))
        buckets[smallest].append(item)
        sizes[smallest] += _item_nbytes(item)
    return [b for b in buckets if b]


def write_dcp_file(path: Path, name: str, items: List[WriteItem], resolve: Callable[[WriteItem], ItemData],
                   recorder: Recorder, zip_crc32: bool = True, caller: Optional[CallerStreams] = None,
                   extensions: Sequence[Any] = (), content: Optional[ContentLog] = None,
                   reuse: Optional[Reuse] = None) -> List[WriteResult]:
    """One ``.distcp`` file: ``items`` in order, each hashed into ``recorder``, one fsync.

    Each item starts at a multiple of ``ITEM_ALIGNMENT`` bytes (zeros in between, in no item:
    every reader, torch's included, reads an item by its offset and length), so a tensor's data,
    which torch's zip format aligns within the item, is 64-byte aligned in the file as in the
    destination tensor: the kernel copied 540 MiB of misaligned data from the page cache in
    59 ms against 45 ms aligned (2 ranks at once), and a warm 2-rank load of the benchmark's
    state took 120 ms instead of 130.

    A tensor in device memory is copied to the host one item ahead (``_in_host_memory``), after
    the work the caller (``caller``: its streams, taken on its thread) had queued.

    ``extensions``: DCP stream transforms (``StreamTransformExtension``, e.g. torch's
    ``ZStandard``), applied to every item as torch's writer applies them; the item's
    ``transform_descriptors`` say which, so any DCP reader undoes them. The checksum covers
    the bytes as stored (transformed).

    ``content``: each tensor item's content digest is recorded there (``incremental``);
    ``reuse``: an item equal to the base's is referenced there instead of written."""
    results = []
    with open(path, "wb", buffering=WRITE_BUFFER_BYTES) as raw:
        stream = HashingWriter(raw)
        for item, data in _in_host_memory(items, resolve, HostCopies(caller)):
            tensor: Optional[torch.Tensor] = None
            content_hash: Optional[str] = None
            blob = None if extensions or content is not None or isinstance(data, io.BytesIO) else small_tensor_record(data)
            if blob is not None:  # the common case of many small tensors: one blob, one call each
                offset, length, digest = stream.write_item(blob, ITEM_ALIGNMENT)
                recorder.add(name, offset, length, digest, item.index.fqn)
                info = _StorageInfo(name, offset, length)
                results.append(made(WriteResult, index=item.index, size_in_bytes=length, storage_data=info))
                del data
                continue
            if not isinstance(data, io.BytesIO):
                tensor = data.detach()
                if not tensor.is_contiguous():
                    tensor = tensor.contiguous()  # one item's copy at a time, never the whole storage
                del data  # one tensor alive at a time (streamed saves depend on it)
                if content is not None:
                    content_hash = content_digest(tensor)
                    referenced = reuse.reference(item, content_hash, recorder, content) if reuse else None
                    if referenced is not None:
                        results.append(referenced)
                        continue
            stream.start_item(ITEM_ALIGNMENT)
            sink, descriptors = transformed_stream(stream, extensions)
            if tensor is None:  # a BYTE_IO item
                sink.write(cast(io.BytesIO, data).getbuffer())
            else:
                write_tensor_record(sink.write, tensor, zip_crc32=zip_crc32,
                                    expect_data=None if descriptors else stream.expect_data)
                tensor = None
            if descriptors:
                sink.close()  # the transforms' last bytes, into ``stream``
            offset, length, digest = stream.finish_item()
            recorder.add(name, offset, length, digest, item.index.fqn, stream.last_blocks)
            if content is not None and content_hash is not None:
                content.add(name, offset, item, content_hash, descriptors)
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=_StorageInfo(name, offset, length,
                                                                 transform_descriptors=descriptors or None)))
        raw.flush()
        os.fsync(raw.fileno())
        wrote_nothing = stream.tell() == 0
    if wrote_nothing and items:  # every item referenced in a base: no empty file beside them
        path.unlink()
    return results


def _in_host_memory(items: List[WriteItem], resolve: Callable[[WriteItem], ItemData], copies: HostCopies
                    ) -> Iterator[Tuple[WriteItem, ItemData]]:
    """Each item with its data in host memory, in order. A device tensor's copy to the host is
    started, and the item after it resolved, before it is handed out, so the next copy runs while
    this one is written (as torch's ``_OverlappingCpuLoader`` does). Only a device copy waits
    ahead: items of host tensors are handed out as resolved, so a save that makes its host tensors
    one at a time (streamed saves) still holds one of them at a time."""
    ahead: Optional[Tuple[WriteItem, HostCopy]] = None
    for item in items:
        data = resolve(item)
        started: Optional[HostCopy] = None
        if isinstance(data, torch.Tensor) and not is_host_memory(data):
            started = copies.start(data.detach())
            del data
        if ahead is not None:
            yield ahead[0], ahead[1].result()
            ahead = None
        if started is not None:
            ahead = (item, started)
        else:
            yield item, data
    if ahead is not None:
        yield ahead[0], ahead[1].result()


def write_dcp_files(checkpoint_dir: Path, prefix: str, items: List[WriteItem], resolve: Callable[[WriteItem], ItemData],
                    recorder: Recorder, thread_count: int = 1, zip_crc32: bool = True,
                    first_file: int = 0, extensions: Sequence[Any] = (), content: Optional[ContentLog] = None,
                    reuse: Optional[Reuse] = None) -> List[WriteResult]:
    """Write ``items`` into ``{prefix}{i}.distcp`` files (one per thread), hashed, fsynced
    once each; ``zip_crc32=False`` leaves the zip CRC fields 0 (see ``write_tensor_record``);
    ``extensions``: DCP stream transforms of every item (``write_dcp_file``)."""
    buckets = _buckets(items, thread_count)
    results: List[List[WriteResult]] = [[] for _ in buckets]
    caller = CallerStreams()  # the writer threads' copies of device tensors wait for the caller's queued work

    def run(i: int) -> None:
        name = f"{prefix}{first_file + i}.distcp"
        results[i] = write_dcp_file(Path(checkpoint_dir) / name, name, buckets[i], resolve, recorder, zip_crc32,
                                    caller, extensions, content, reuse)

    each_in_a_thread(len(buckets), run, "dist_ckpt-writer")
    return [r for rs in results for r in rs]


class _KeepOpen(io.RawIOBase):
    """The file stream as the innermost transform's target: closing the transforms (which
    cascade their close) flushes them into the file without closing it."""

    def __init__(self, stream: HashingWriter) -> None:
        super().__init__()
        self._stream = stream

    def writable(self) -> bool:
        return True

    def write(self, data: Any) -> int:
        return self._stream.write(data)


def checked_extensions(extensions: Optional[Sequence[Any]]) -> Tuple[Any, ...]:
    """``extensions`` as a tuple, each a DCP ``StreamTransformExtension``: anything else fails
    here, when the writer is made, not in the middle of a save."""
    from torch.distributed.checkpoint._extension import StreamTransformExtension

    checked = tuple(extensions or ())
    for extension in checked:
        if not isinstance(extension, StreamTransformExtension):
            raise CheckpointingException(f"_extensions takes torch.distributed.checkpoint._extension.StreamTransformExtension "
                            f"objects (e.g. ZStandard()), not {type(extension).__name__}")
    return checked


def transformed_stream(stream: HashingWriter, extensions: Sequence[Any]) -> Tuple[Any, List[str]]:
    """Where an item's bytes go: ``stream`` itself without extensions, else the chain of their
    ``transform_to`` around it (the first extension innermost, as torch chains them), and the
    descriptors that undo it, outermost first (what torch records in ``transform_descriptors``)."""
    if not extensions:
        return stream, []
    sink: Any = _KeepOpen(stream)
    for extension in extensions:
        sink = extension.transform_to(sink)
    return sink, [extension.get_descriptor() for extension in reversed(extensions)]


def write_dcp_metadata(checkpoint_dir: Path, metadata: Metadata, results: List[WriteResult], recorder: Recorder,
                       checkpoint_id: Optional[str] = None) -> None:
    """Coordinator: complete ``metadata`` with where every item went and write ``.metadata``
    (``checkpoint_id``: the directory the checkpoint is committed to, if not ``checkpoint_dir``)."""
    metadata.version = DCP_FORMAT_VERSION
    metadata.storage_data = {r.index: r.storage_data for r in results}
    save_id = getattr(metadata.storage_meta, "save_id", None)
    metadata.storage_meta = StorageMeta(checkpoint_id=checkpoint_id or str(checkpoint_dir), save_id=save_id)
    content = portable_metadata_bytes(metadata)  # five-field TensorProperties: every torch release reads it
    recorder.add(DCP_METADATA_FNAME, 0, len(content), hash_bytes(content))
    atomic_write_bytes(Path(checkpoint_dir) / DCP_METADATA_FNAME, content)  # fsyncs the directory too


_dcp_allowlist: Dict[str, Any] = {}


def _dcp_metadata_allowlist() -> Dict[str, Any]:
    """What a DCP ``.metadata`` pickle may reference: DCP's metadata and planner classes, their
    storage records, Megatron-Core's placeholder classes, and the plain builtins. Built once."""
    if _dcp_allowlist:
        return _dcp_allowlist
    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.distributed.checkpoint.planner as dcp_planner

    allowed = plain_pickle_builtins()
    for module in (dcp_md, dcp_planner):
        for name in getattr(module, "__all__", None) or dir(module):
            obj = getattr(module, name, None)
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                allowed[f"{module.__name__}.{name}"] = obj
    allowed["torch.distributed.checkpoint.metadata._MEM_FORMAT_ENCODING"] = dcp_md._MEM_FORMAT_ENCODING
    allowed["torch.distributed.checkpoint.filesystem._StorageInfo"] = dcp_fs._StorageInfo
    allowed["torch.distributed.checkpoint.filesystem._StoragePrefix"] = dcp_fs._StoragePrefix
    # Megatron-Core pickled its own (empty) classes of these names into some .metadata files.
    for cls in (MCoreMetadata, MCoreSavePlan):
        allowed[f"megatron.core.dist_checkpointing.strategies.torch.{cls.__name__}"] = cls
    _dcp_allowlist.update(allowed)
    return _dcp_allowlist


def load_dcp_metadata_pickle(file: Any, what: str) -> Any:
    """Unpickle a DCP ``.metadata`` with the allowlist above (nothing else imported or called).
    A DCP class or a dtype the running torch does not have is a newer torch's format
    (``UnsupportedFormatError``), not an unsafe pickle."""
    return safe_pickle_load(file, what, _dcp_metadata_allowlist(), refused=_newer_torch_name, stand_ins=_STAND_INS)


# five fields (torch <= 2.14) or six (2.15's strides), whichever torch runs
_STAND_INS = {"torch.distributed.checkpoint.metadata.TensorProperties": TensorPropertiesOfAnyRelease}


_DCP_PACKAGE = "torch.distributed.checkpoint"


def _newer_torch_name(name: str) -> Optional[Exception]:
    """Our error for a refused global that a newer torch would resolve: a name directly in
    ``torch`` (a dtype: torch 2.15 added ``bcomplex32``) or in DCP's package that the running
    torch does not have; None for anything else, which stays refused as unsafe. Nothing is
    imported: modules are looked up among those loaded, or found without running them."""
    module_name, _, attr = name.rpartition(".")
    if module_name != "torch" and module_name != _DCP_PACKAGE and not module_name.startswith(_DCP_PACKAGE + "."):
        return None
    module = sys.modules.get(module_name)
    if module is None and _is_missing(module_name) is not True:
        return None  # it may exist here, unloaded: refused as unsafe, not guessed at
    if module is not None and hasattr(module, attr):
        return None  # it exists here and is not allowed: refused as unsafe
    return UnsupportedFormatError(f"it names {name}, which torch {torch.__version__} does not have (a newer "
                                  f"torch's {'dtype or class' if module_name == 'torch' else 'DCP format'})")


def _is_missing(module_name: str) -> Optional[bool]:
    """Whether the running torch lacks module ``module_name``, found from its nearest loaded
    package without importing anything; None where that cannot be told without importing."""
    parent_name, _, last = module_name.rpartition(".")
    parent = sys.modules.get(parent_name)
    if parent is None:
        return _is_missing(parent_name) if "." in parent_name else None
    path = getattr(parent, "__path__", None)
    if path is None:
        return True  # a plain module has no submodules
    return importlib.machinery.PathFinder.find_spec(last, list(path)) is None


_MAX_COUNT = 1 << 62  # no tensor has more elements (or a larger dimension) than this


def _is_dim(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _MAX_COUNT


def _chunk_inside(offsets: Any, sizes: Any, size: Sequence[int]) -> bool:
    """A chunk's offsets and sizes are sequences of the tensor's rank, of ints (not bools) from 0,
    and the chunk lies inside ``size``."""
    return (isinstance(offsets, (tuple, list)) and isinstance(sizes, (tuple, list))
            and len(offsets) == len(size) and len(sizes) == len(size)
            and all(_is_dim(o) and _is_dim(n) and o + n <= d for o, n, d in zip(offsets, sizes, size)))


_PLAIN_SEQUENCES = (torch.Size, tuple, list)


def _plainly_inside(offsets: Any, sizes: Any, size: Sequence[int], ndim: int) -> bool:
    """``_chunk_inside`` for the common case, fast: offsets and sizes of the tensor's rank
    (``ndim``), of plain ints (exactly ``int``), not negative, the chunk inside ``size`` (whose
    axes are checked already). False sends the chunk to ``_chunk_inside``, which decides. Why:
    its generator and two calls per axis were a third of reading and checking an index of 8,000
    chunks (the coordinator of 8 ranks of 1,000 keys)."""
    if type(offsets) not in _PLAIN_SEQUENCES or type(sizes) not in _PLAIN_SEQUENCES:
        return False
    if len(offsets) != ndim or len(sizes) != ndim:
        return False
    for o, n, d in zip(offsets, sizes, size):
        if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > d:
            return False
    return True


def _validate_item_metadata(path: Path, key: Any, md: Any,
                            inside: Optional[Set[Tuple[int, int, int]]] = None) -> None:
    """Every field of an item's metadata, before anything is sized from it: a non-dtype,
    negative or overflowing sizes, chunks outside the tensor are our error, naming the key.
    ``inside``: the ids of (offsets, sizes, size) objects found inside before, in this index
    (alive while it is): an index whose equal sizes are one object (``shared_sizes``) checks
    each combination once, not once per chunk."""
    if not isinstance(key, str):
        raise CorruptCheckpointError(f"{path}: an item key is not a string ({type(key).__name__})")
    if isinstance(md, BytesStorageMetadata):
        return
    if not isinstance(md, TensorStorageMetadata):
        raise CorruptCheckpointError(f"{path}: item '{key}' has metadata of type {type(md).__name__}")
    dtype = getattr(getattr(md, "properties", None), "dtype", None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"{path}: tensor '{key}' has dtype {dtype!r}, not a torch.dtype")
    size = md.size
    if not isinstance(size, (tuple, list)) or not all(_is_dim(n) for n in size) or math.prod(size) >= _MAX_COUNT:
        raise CorruptCheckpointError(f"{path}: tensor '{key}' has an invalid size {str(size)[:100]}")
    if not isinstance(md.chunks, list):
        raise CorruptCheckpointError(f"{path}: tensor '{key}' has no list of chunks")
    ndim = len(size)
    for chunk in md.chunks:
        offsets, sizes = getattr(chunk, "offsets", None), getattr(chunk, "sizes", None)
        if inside is not None and (id(offsets), id(sizes), id(size)) in inside:
            continue
        if _plainly_inside(offsets, sizes, size, ndim) or _chunk_inside(offsets, sizes, size):
            if inside is not None and type(offsets) is type(sizes) is type(size) is torch.Size:  # immutable
                inside.add((id(offsets), id(sizes), id(size)))
        else:
            raise CorruptCheckpointError(
                f"{path}: tensor '{key}' (size {tuple(size)}) has a chunk at offsets {str(offsets)[:60]} with sizes "
                f"{str(sizes)[:60]} outside it"
            )


def newer_format_error(path: Path, what: str, verified: bool) -> UnsupportedFormatError:
    """The error for an index in a form the running torch cannot read: ``what`` it holds, whether
    its bytes are the ones written (``verified`` against the manifest), who wrote the checkpoint
    (its writer record) and what to install."""
    intact = ("its bytes match their checksum, so this is not damage" if verified else
              "no checksum was checked (no manifest, or verification off)")
    return UnsupportedFormatError(
        f"{path} is in a DCP format this torch ({torch.__version__}) cannot read: {what}. A newer format: {intact}; "
        f"{describe_writer(path.parent)}. Load it under the torch release that wrote it or a newer one, or with "
        f"a newer dist_ckpt; a checkpoint that dist_ckpt writes loads under torch 2.11 to 2.15."
    )


_metadata_cache: ParsedFileCache[Metadata] = ParsedFileCache(8)  # the checked index, per .metadata version


class DcpReader(FileSystemReader):
    """DCP's reader with the allowlisted unpickler, checksum verification and checked offsets,
    sizes and file names; items are read by ``thread_count`` threads."""

    def __init__(self, path: Any, thread_count: int = 1, extension_registry: Optional[Any] = None) -> None:
        super().__init__(path, _extension_registry=extension_registry)
        self.thread_count = thread_count

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checked index; parsed once per file version and process (a streaming tool loads one
        tensor per call: re-reading a 100,000-entry index each time made convert quadratic)."""
        path = Path(self.path) / DCP_METADATA_FNAME
        try:
            st = path.stat()
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(f"{path} is missing: not a complete torch_dist checkpoint") from None
        # checked (or not) with the verification setting of this call: that is part of the key
        key = (os.path.abspath(path), st.st_ino, st.st_mtime_ns, st.st_size, verification_enabled())
        cached = _metadata_cache.get(key)
        if cached is None:
            cached = self._read_checked_metadata(path)
            _metadata_cache.put(key, cached)
        return copy.copy(cached)  # callers may replace its tables (remove_sharded_tensors), not ours

    def _read_checked_metadata(self, path: Path) -> Metadata:
        if not path.is_file():
            raise CheckpointNotFoundError(f"{path} is missing: not a complete torch_dist checkpoint")
        size = path.stat().st_size  # before reading: a file of any size is not read whole
        if size > MAX_DCP_METADATA_BYTES:
            raise CorruptCheckpointError(
                f"{path} is {size} bytes, more than the {MAX_DCP_METADATA_BYTES} a DCP index of any real model takes"
            )
        content = path.read_bytes()
        verify_bytes(self.path, DCP_METADATA_FNAME, 0, content, what="the DCP index")
        try:
            metadata = load_dcp_metadata_pickle(io.BytesIO(content), what=str(path))
        except UnsupportedFormatError as e:
            verified = verification_enabled() and load_manifest(self.path) is not None
            raise newer_format_error(path, str(e), verified) from None
        try:
            return self._checked(path, metadata)
        except (AttributeError, TypeError, ValueError, KeyError, IndexError) as e:
            if isinstance(e, CorruptCheckpointError):
                raise
            # a damaged pickle can build objects whose attributes have other names or types
            raise CorruptCheckpointError(f"{path} is damaged: its index does not have the structure of DCP "
                                         f"metadata ({type(e).__name__}: {e})") from None

    def _checked(self, path: Path, metadata: Any) -> Metadata:
        # a damaged pickle can build a Metadata whose attributes have other names: getattr
        if not isinstance(metadata, Metadata) or not isinstance(getattr(metadata, "state_dict_metadata", None), dict):
            raise CorruptCheckpointError(f"{path} does not hold DCP checkpoint metadata")
        if not isinstance(getattr(metadata, "storage_data", None), dict):
            raise CorruptCheckpointError(f"{path} has no storage table (storage_data)")
        inside: Set[Tuple[int, int, int]] = set()
        for key, item_md in metadata.state_dict_metadata.items():
            _validate_item_metadata(path, key, item_md, inside)
        plain_names: Set[str] = set()  # each file name checked once: a few files hold thousands of items
        for index, info in metadata.storage_data.items():
            name = getattr(info, "relative_path", None)
            if type(name) is not str or name not in plain_names:
                if not isinstance(name, str) or not name or "/" in name or "\\" in name or name in (".", ".."):
                    raise CorruptCheckpointError(
                        f"{path} names data file {name!r}, which is not a plain file name inside the checkpoint"
                    )
                plain_names.add(name)
            if not (_is_count(getattr(info, "offset", None)) and _is_count(getattr(info, "length", None))):
                raise CorruptCheckpointError(f"{path}: item '{index.fqn}' has an invalid offset or length")
        return metadata

    def check_plan(self, storage_data: Mapping[MetadataIndex, Any], items: List[ReadItem],
                   chunk_nbytes: List[int]) -> None:
        """Before anything is allocated: every item must lie inside its file, and each tensor
        chunk must fit in the bytes recorded for it (so hostile metadata cannot make us
        allocate more than the checkpoint holds)."""
        sizes: Dict[str, int] = {}
        for item, nbytes in zip(items, chunk_nbytes):
            info = storage_data.get(item.storage_index)
            if info is None:
                raise CorruptCheckpointError(
                    f"'{item.storage_index.fqn}' (chunk at {list(item.storage_index.offset or [])}) has no "
                    f"entry in the storage table of {self.path}/.metadata"
                )
            name = info.relative_path
            if name not in sizes:
                try:
                    sizes[name] = os.stat(Path(self.path) / name).st_size
                except FileNotFoundError:
                    raise CorruptCheckpointError(
                        f"data file {Path(self.path) / name} is missing; it holds '{item.storage_index.fqn}'"
                    ) from None
            if info.offset + info.length > sizes[name]:
                raise CorruptCheckpointError(
                    f"{Path(self.path) / name}: '{item.storage_index.fqn}' is recorded at bytes [{info.offset}, "
                    f"{info.offset}+{info.length}) but the file has {sizes[name]} bytes; the file is truncated "
                    f"or the metadata is damaged"
                )
            if nbytes > info.length and not getattr(info, "transform_descriptors", None):  # a transformed
                raise CorruptCheckpointError(                                               # item may be smaller
                    f"'{item.storage_index.fqn}': .metadata claims a chunk of {nbytes} bytes stored in "
                    f"{info.length} bytes; the metadata is damaged"
                )

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Any:
        """Every item of ``plan`` into the planner's destinations (``read``: direct reads,
        ``thread_count`` threads, checksums while reading); non-tensor items through ``_apply``."""
        groups: Dict[Tuple[str, int], ItemGroup] = {}
        for item in plan.items:
            info = self.storage_data.get(item.storage_index)
            if info is None:
                raise CorruptCheckpointError(
                    f"'{item.storage_index.fqn}' (chunk at {list(item.storage_index.offset or [])}) has no "
                    f"entry in the storage table of {self.path}/.metadata"
                )
            key = (info.relative_path, info.offset)
            if key not in groups:
                groups[key] = ItemGroup(info.relative_path, info.offset, info.length, info)
            groups[key].items.append(item)
        manifest = load_manifest(self.path) if verification_enabled() else None

        def fallback(group: ItemGroup, blob: bytes) -> None:
            if group.transformed:
                blob = self._untransformed(group, blob)
            for item in group.items:
                self._apply(blob, Path(self.path) / group.file, item, planner)

        read_item_groups(Path(self.path), list(groups.values()), planner, manifest, fallback, self.thread_count)
        future: Any = torch.futures.Future()
        future.set_result(None)
        return future

    def _untransformed(self, group: ItemGroup, blob: bytes) -> bytes:
        """An item's bytes with its DCP stream transforms undone (decompressed, ...)."""
        descriptors = list(group.info.transform_descriptors)
        try:
            transforms = self.transforms.extension_registry.from_descriptor_list(descriptors)
        except ValueError as e:
            raise CheckpointingException(
                f"{Path(self.path) / group.file}: '{group.items[0].storage_index.fqn}' was written through the stream "
                f"transforms {descriptors}, which this reader does not know ({e}); register them in an "
                f"ExtensionRegistry and pass it (FileSystemReader(_extension_registry=...), "
                f"TorchDistLoadShardedStrategy(extension_registry=...))") from None
        from torch.distributed.checkpoint._extension import StreamTransformExtension

        # The writer (torch's, and ``transformed_stream``) records the descriptors outermost-first
        # in the order the data went through them, so the stored bytes carry the last one's
        # encoding on the outside: it is undone first. (torch's own reader applies them in the
        # recorded order, which undoes a single transform right, but fails on a chain of two.)
        stream: Any = io.BytesIO(blob)
        for transform in reversed(transforms):
            if isinstance(transform, StreamTransformExtension):
                stream = transform.transform_from(stream)
        return stream.read()

    @staticmethod
    def _apply(blob: bytes, path: Path, item: ReadItem, planner: LoadPlanner) -> None:
        what = f"'{item.storage_index.fqn}' in {path}"
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(blob))
            return
        tensor = safe_torch_load(blob, what=what)
        if not isinstance(tensor, torch.Tensor):
            raise CorruptCheckpointError(f"{what} does not hold a tensor chunk of {len(item.storage_offsets)} axes")
        copy_region(tensor, item, planner, what)


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 62)

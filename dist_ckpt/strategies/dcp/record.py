"""One tensor as a ``torch.save`` zip record, written and located without ``torch.save``.

Every tensor item of a 'torch_dist' checkpoint is a standalone ``torch.save`` blob (what DCP's
``FileSystemWriter`` and Megatron-Core write, and what ``torch.load`` reads). Going through
``torch.save``/``torch.load`` costs the fast paths what they exist to avoid:

* ``torch.save`` computes the zip CRC32 of the data while holding the GIL (writer threads
  cannot overlap) and needs a clone of a view whose storage is larger than the view;
* ``torch.load`` of a blob read into ``bytes`` copies the data into a new storage, which is
  then copied again into the destination.

So the writer here emits the same zip (records ``data.pkl``, ``.format_version``,
``.storage_alignment``, ``byteorder``, ``data/0``, ``version``, ``.data/serialization_id``;
data 64-byte aligned; zip64 when a record or offset needs it) with the CRC32 computed by
``zlib.crc32`` (GIL released) and the tensor's bytes handed to the stream as views of its
memory; and ``locate_tensor_data`` finds where a stored tensor's bytes lie inside a blob from
its central directory and a restricted unpickling of ``data.pkl``, so a reader can put them
straight into the destination. Anything unusual (compression, another pickle form, a view
into a larger storage) makes ``locate_tensor_data`` return None and the caller falls back to
``torch.load`` through the safe unpickler.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import io
import math
import pickle
import struct
import threading
import zlib
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...runtime.devices import is_host_memory
from ...standalone.tensor_records import ONE_WRITE, RecordLayout, small_record, write_record

__all__ = ["StoredTensor", "write_tensor_record", "small_tensor_record", "record_layout", "written_layout",
           "locate_tensor_data", "layout_signature", "LayoutCache", "tensor_bytes"]

ALIGNMENT = 64  # what torch.save writes into .storage_alignment (data starts 64-byte aligned)
ZIP64_LIMIT = 0xFFFFFFFF  # a size or offset at or above this goes into a zip64 extra field
_ZIP64_MARK = 0xFFFFFFFF  # what a 32-bit field holds when the value is in the zip64 extra field
_PREFIX = "archive/"  # torch.save's record prefix for a stream
_DOS_DATE = (0 << 9) | (1 << 5) | 1  # 1980-01-01: the zip format cannot say "no date"

_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_EOCD = struct.Struct("<IHHHHIIH")
_EOCD64 = struct.Struct("<IQHHIIQQQQ")
_LOCATOR64 = struct.Struct("<IIQI")
_LOCAL_SIG, _CENTRAL_SIG, _EOCD_SIG = 0x04034B50, 0x02014B50, 0x06054B50
_EOCD64_SIG, _LOCATOR64_SIG = 0x06064B50, 0x07064B50
_UTF8_FLAG = 0x800


def tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous tensor in host memory (``is_host_memory``), as a flat view of its
    memory (no copy)."""
    flat = tensor.reshape(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    if flat.stride(0) != 1:  # a one-element tensor may keep any stride; its memory is contiguous
        flat = flat.as_strided((flat.numel(),), (1,))
    return memoryview(flat.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy arrays are buffers


@functools.lru_cache(maxsize=None)
def _storage_class(dtype: torch.dtype) -> Optional[Any]:
    """The legacy storage class torch.save names in data.pkl for ``dtype`` (torch.FloatStorage...);
    None for the dtypes that have none (float8, uint16...), which torch pickles by bytes.

    Read from torch's table, not from ``TypedStorage._pickle_storage_type``: that one warns
    (TypedStorage is deprecated), and silencing it takes ``warnings.catch_warnings``, which swaps
    the process's warning filters and races with every other thread that touches them."""
    name = torch.storage._dtype_to_storage_type_map().get(dtype)
    return getattr(torch, name) if name is not None else None


class _StorageRef:
    """Stands for the tensor's storage while pickling: becomes the persistent id torch writes."""

    def __init__(self, dtype: torch.dtype, numel: int) -> None:
        self.dtype, self.numel = dtype, numel


class _TensorRebuild:
    """Pickles as torch.save pickles a contiguous tensor that owns its storage: through
    ``_rebuild_tensor_v2`` and a typed storage, or ``_rebuild_tensor_v3`` (untyped storage of
    bytes, dtype last) for the dtypes without a legacy storage class."""

    def __init__(self, storage: _StorageRef, shape: Tuple[int, ...]) -> None:
        self.storage, self.shape = storage, shape

    def __reduce__(self) -> Any:
        stride: List[int] = []
        acc = 1
        for n in reversed(self.shape):
            stride.append(acc)
            acc *= n
        args: Tuple[Any, ...] = (self.storage, 0, self.shape, tuple(reversed(stride)), False, collections.OrderedDict())
        if _storage_class(self.storage.dtype) is None:
            return torch._utils._rebuild_tensor_v3, args + (self.storage.dtype,)
        return torch._utils._rebuild_tensor_v2, args


class _TorchPickler(pickle.Pickler):
    def persistent_id(self, obj: Any) -> Any:
        if not isinstance(obj, _StorageRef):
            return None
        cls = _storage_class(obj.dtype)
        if cls is None:
            nbytes = obj.numel * obj.dtype.itemsize
            return ("storage", torch.storage.UntypedStorage, "0", "cpu", nbytes)
        return ("storage", cls, "0", "cpu", obj.numel)


def _tensor_pickle(dtype: torch.dtype, shape: Tuple[int, ...]) -> bytes:
    """``data.pkl`` as torch.save writes it for a contiguous tensor that owns its storage."""
    buffer = io.BytesIO()
    numel = 1
    for n in shape:
        numel *= n
    _TorchPickler(buffer, protocol=2).dump(_TensorRebuild(_StorageRef(dtype, numel), tuple(shape)))
    return buffer.getvalue()


def _zip64_extra(size: int, offset: Optional[int]) -> bytes:
    fields = [size, size] + ([offset] if offset is not None else [])
    return struct.pack("<HH", 1, 8 * len(fields)) + struct.pack(f"<{len(fields)}Q", *fields)


def _padding(position: int, name_len: int, extra_len: int) -> bytes:
    """torch's 'FB' extra field that puts the record's data at a multiple of ALIGNMENT."""
    pad = -(position + _LOCAL.size + name_len + extra_len) % ALIGNMENT
    if pad == 0:
        return b""
    if pad < 4:
        pad += ALIGNMENT
    return b"FB" + struct.pack("<H", pad - 4) + b"Z" * (pad - 4)


@dataclass
class _Record:
    name: bytes
    data: Any  # bytes, or _Sized for the tensor's data (only its length is needed)
    crc: int
    offset: int = 0


class _Sized:
    def __init__(self, nbytes: int) -> None:
        self.nbytes = nbytes

    def __len__(self) -> int:
        return self.nbytes


_DATA_NAME = (_PREFIX + "data/0").encode()
_LOCAL_CRC_AT, _CENTRAL_CRC_AT = 14, 16  # where the CRC32 field sits in a local / central header


def _records(dtype: torch.dtype, shape: Tuple[int, ...], nbytes: int) -> List[_Record]:
    pkl = _tensor_pickle(dtype, shape)
    items = [("data.pkl", pkl), (".format_version", b"1"), (".storage_alignment", str(ALIGNMENT).encode()),
             ("byteorder", b"little"), ("data/0", _Sized(nbytes)), ("version", b"3\n"),
             (".data/serialization_id", b"0" * 40)]
    return [_Record((_PREFIX + n).encode(), d, zlib.crc32(d) if isinstance(d, bytes) else 0) for n, d in items]


def _local_header(record: _Record, position: int) -> bytes:
    size = len(record.data)
    big = size >= ZIP64_LIMIT
    extra = _zip64_extra(size, None) if big else b""
    extra += _padding(position, len(record.name), len(extra))
    stored = _ZIP64_MARK if big else size
    header = _LOCAL.pack(_LOCAL_SIG, 45 if big else 20, _UTF8_FLAG, 0, 0, _DOS_DATE, record.crc, stored, stored,
                         len(record.name), len(extra))
    return header + record.name + extra


def _central_directory(records: List[_Record], start: int) -> Tuple[bytes, List[int]]:
    """The central directory and end records; and where each record's entry starts in it."""
    out, at, pos = [], [], 0
    for r in records:
        size = len(r.data)
        big = size >= ZIP64_LIMIT or r.offset >= ZIP64_LIMIT
        extra = _zip64_extra(size, r.offset) if big else b""
        stored, offset = (_ZIP64_MARK, _ZIP64_MARK) if big else (size, r.offset)
        entry = _CENTRAL.pack(_CENTRAL_SIG, 45 if big else 20, 45 if big else 20, _UTF8_FLAG, 0, 0, _DOS_DATE,
                              r.crc, stored, stored, len(r.name), len(extra), 0, 0, 0, 0, offset) + r.name + extra
        at.append(pos)
        out.append(entry)
        pos += len(entry)
    directory = b"".join(out)
    end = start + len(directory)
    n = len(records)
    eocd64 = _EOCD64.pack(_EOCD64_SIG, _EOCD64.size - 12, 45, 45, 0, 0, n, n, len(directory), start)
    locator = _LOCATOR64.pack(_LOCATOR64_SIG, 0, end, 1)
    fits = start < ZIP64_LIMIT and len(directory) < ZIP64_LIMIT
    eocd = _EOCD.pack(_EOCD_SIG, 0, 0, n, n, len(directory) if fits else _ZIP64_MARK,
                      start if fits else _ZIP64_MARK, 0)
    return directory + eocd64 + locator + eocd, at


@functools.lru_cache(maxsize=4096)
def _layout(dtype: torch.dtype, shape: Tuple[int, ...], zip64_limit: int) -> RecordLayout:
    """Built once per (dtype, shape): a model's tensors share few shapes, and the per-tensor
    cost of many small tensors is then one CRC, two 4-byte patches and one write."""
    numel = 1
    for n in shape:
        numel *= n
    records = _records(dtype, shape, numel * dtype.itemsize)
    before, after = bytearray(), bytearray()
    position, prefix_crc_at = 0, -1
    for r in records:
        r.offset = position
        header = _local_header(r, position)
        position += len(header) + len(r.data)
        if r.name == _DATA_NAME:
            prefix_crc_at = len(before) + _LOCAL_CRC_AT
            before += header
        elif prefix_crc_at < 0:
            before += header + r.data
        else:
            after += header + r.data
    directory, entry_at = _central_directory(records, position)
    data_entry = next(i for i, r in enumerate(records) if r.name == _DATA_NAME)
    suffix_crc_at = len(after) + entry_at[data_entry] + _CENTRAL_CRC_AT
    return RecordLayout(bytes(before), bytes(after + directory), prefix_crc_at, suffix_crc_at)


def record_layout(dtype: torch.dtype, shape: Tuple[int, ...]) -> RecordLayout:
    """The layout ``write_tensor_record`` gives the record of a tensor of ``dtype`` and ``shape``
    (for a writer that writes the record from the tensor's bytes alone: ``standalone``)."""
    return _layout(dtype, tuple(shape), ZIP64_LIMIT)


def written_layout(dtype: torch.dtype, shape: Tuple[int, ...]) -> Tuple["StoredTensor", int]:
    """Where ``write_tensor_record`` puts the bytes of a tensor of ``dtype`` and ``shape``, and
    the length of the blob it writes: a reader can predict a blob's layout from ``.metadata``
    alone (and must check it against the blob's bytes once read: another writer, or another
    torch, may lay out a blob of the same length otherwise)."""
    layout = _layout(dtype, tuple(shape), ZIP64_LIMIT)
    nbytes = math.prod(shape) * dtype.itemsize
    return StoredTensor(dtype, tuple(shape), len(layout.prefix), nbytes), len(layout.prefix) + nbytes + len(layout.suffix)


def small_tensor_record(tensor: torch.Tensor) -> Optional[bytes]:
    """The whole blob ``write_tensor_record`` writes for ``tensor``, as one bytes object, when the
    tensor is small (under ``ONE_WRITE`` bytes: its CRC is always computed), contiguous and in
    host memory; else None."""
    if not tensor.is_contiguous() or not is_host_memory(tensor) or tensor.is_conj() or tensor.is_neg():
        return None
    nbytes = tensor.numel() * tensor.dtype.itemsize
    if nbytes >= ONE_WRITE:
        return None
    layout = _layout(tensor.dtype, tuple(tensor.shape), ZIP64_LIMIT)
    if tensor.is_cpu and nbytes:
        data: Any = ctypes.string_at(tensor.data_ptr(), nbytes)  # one call: a tenth of ``tensor_bytes``' three
    else:
        data = tensor_bytes(tensor)
    return small_record(layout, data)


def write_tensor_record(write: Callable[[Any], Any], tensor: torch.Tensor, zip_crc32: bool = True,
                        expect_data: Optional[Callable[[int, int], None]] = None) -> None:
    """Write ``tensor`` (contiguous, CPU) as a ``torch.save`` blob through ``write``.

    The tensor's bytes are passed as memoryviews of its memory in pieces of ``WRITE_PIECE``
    (the caller may hash each piece while it is in cache); nothing of a large tensor's data is
    copied (a small blob goes out as one bytes object: one call instead of three).
    ``zip_crc32=False`` writes 0 as the CRC of large data records, as torch.save does with
    ``torch.serialization.set_crc32_options(False)``: torch >= 2.6 (and so every Megatron-Core
    that runs on it) loads such files, zip tools and older torch report a CRC error. The
    dist_ckpt manifest's xxh3 covers the bytes either way. ``expect_data(data_start, nbytes)``
    is told, before the first write, where in the blob the tensor's bytes will lie (a hashing
    stream hashes them in blocks: ``HashingWriter.expect_data``)."""
    if not tensor.is_contiguous() or not is_host_memory(tensor):
        raise ValueError("write_tensor_record needs a contiguous tensor in host memory")
    layout = _layout(tensor.dtype, tuple(tensor.shape), ZIP64_LIMIT)
    write_record(write, layout, tensor_bytes(tensor), zip_crc32, expect_data)


# -- reading ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredTensor:
    """A tensor inside a blob: ``nbytes`` bytes at ``data_offset`` (from the blob's start) hold
    it contiguously, in ``dtype`` and ``shape``."""

    dtype: torch.dtype
    shape: Tuple[int, ...]
    data_offset: int
    nbytes: int


class _NotPlain(Exception):
    """The pickle is not the plain single-tensor form; the caller uses torch.load instead."""


@functools.lru_cache(maxsize=None)
def _torch_names() -> Dict[str, Any]:
    """``torch.<name>`` globals the plain pickle may use: legacy storage classes (as the dtype
    they hold) and dtypes."""
    out: Dict[str, Any] = {}
    for name in dir(torch):
        obj = getattr(torch, name, None)
        if isinstance(obj, torch.dtype):
            out[name] = obj
    for dtype in set(out.values()):
        cls = _storage_class(dtype)
        if cls is not None:
            out[cls.__name__] = dtype
    return out


_UNTYPED = object()  # torch.storage.UntypedStorage: a storage counted in bytes


class _StorageDesc:
    def __init__(self, dtype: Any, key: str, numel: int) -> None:
        self.dtype, self.key, self.numel = dtype, key, numel


class _TensorDesc:
    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any, requires_grad: Any = None,
                 hooks: Any = None, dtype: Any = None, *rest: Any) -> None:
        if not isinstance(storage, _StorageDesc):
            raise _NotPlain()
        self.storage, self.offset, self.size, self.stride = storage, offset, size, stride
        if storage.dtype is _UNTYPED:
            if not isinstance(dtype, torch.dtype):
                raise _NotPlain()
            self.dtype = dtype
            itemsize = dtype.itemsize
            if storage.numel % itemsize:
                raise _NotPlain()
            self.storage_numel = storage.numel // itemsize
        else:
            if dtype is not None and dtype != storage.dtype:
                raise _NotPlain()
            self.dtype, self.storage_numel = storage.dtype, storage.numel


class _PlainTensorUnpickler(pickle.Unpickler):
    """Resolves nothing but the names of torch's single-tensor pickle, to descriptions."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch._utils" and name in ("_rebuild_tensor_v2", "_rebuild_tensor_v3"):
            return _TensorDesc
        if module == "collections" and name == "OrderedDict":
            return collections.OrderedDict
        if module == "torch.storage" and name == "UntypedStorage":
            return _UNTYPED
        if module == "torch" and name in _torch_names():
            return _torch_names()[name]
        raise _NotPlain()

    def persistent_load(self, pid: Any) -> Any:
        if (not isinstance(pid, tuple) or len(pid) != 5 or pid[0] != "storage"
                or not (isinstance(pid[1], torch.dtype) or pid[1] is _UNTYPED)
                or not isinstance(pid[2], str) or not _is_count(pid[4])):
            raise _NotPlain()
        return _StorageDesc(pid[1], pid[2], pid[4])


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 62)


def _central_entries(tail: memoryview, tail_start: int) -> Optional[Dict[str, Tuple[int, int, int]]]:
    """name -> (local header offset, size, method) from the central directory in ``tail``
    (the blob's last bytes, starting at blob offset ``tail_start``); None if not found there."""
    if len(tail) < _EOCD.size:
        return None
    sig, _, _, _, count, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, len(tail) - _EOCD.size)
    if sig != _EOCD_SIG or comment:
        return None
    if _ZIP64_MARK in (cd_size, cd_offset) or count == 0xFFFF:
        at = len(tail) - _EOCD.size - _LOCATOR64.size
        if at < 0:
            return None
        sig, _, eocd64_offset, _ = _LOCATOR64.unpack_from(tail, at)
        rel = eocd64_offset - tail_start
        if sig != _LOCATOR64_SIG or rel < 0 or rel + _EOCD64.size > len(tail):
            return None
        fields = _EOCD64.unpack_from(tail, rel)
        if fields[0] != _EOCD64_SIG:
            return None
        count, cd_size, cd_offset = fields[7], fields[8], fields[9]
    pos = cd_offset - tail_start
    if pos < 0 or pos + cd_size > len(tail):
        return None
    entries = {}
    for _ in range(count):
        if pos + _CENTRAL.size > len(tail):
            return None
        f = _CENTRAL.unpack_from(tail, pos)
        if f[0] != _CENTRAL_SIG:
            return None
        method, csize, usize, name_len, extra_len, comment_len, offset = f[4], f[8], f[9], f[10], f[11], f[12], f[16]
        name = bytes(tail[pos + _CENTRAL.size : pos + _CENTRAL.size + name_len]).decode("utf-8", "replace")
        extra = tail[pos + _CENTRAL.size + name_len : pos + _CENTRAL.size + name_len + extra_len]
        if _ZIP64_MARK in (csize, usize, offset):
            wide = _zip64_fields(extra)
            if wide is None:
                return None
            it = iter(wide)
            usize = next(it, None) if usize == _ZIP64_MARK else usize
            csize = next(it, None) if csize == _ZIP64_MARK else csize
            offset = next(it, None) if offset == _ZIP64_MARK else offset
            if None in (usize, csize, offset):
                return None
        if csize != usize:
            return None
        entries[name] = (offset, usize, method)
        pos += _CENTRAL.size + name_len + extra_len + comment_len
    return entries


def _zip64_fields(extra: memoryview) -> Optional[List[int]]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            body = extra[pos + 4 : pos + 4 + size]
            return list(struct.unpack_from(f"<{len(body) // 8}Q", body))
        pos += 4 + size
    return None


def _data_start(head: memoryview, header_offset: int) -> Optional[int]:
    if header_offset + _LOCAL.size > len(head):
        return None
    f = _LOCAL.unpack_from(head, header_offset)
    if f[0] != _LOCAL_SIG:
        return None
    return header_offset + _LOCAL.size + f[9] + f[10]


def locate_tensor_data(head: memoryview, tail: memoryview, blob_length: int) -> Optional[StoredTensor]:
    """Where the tensor of a ``torch.save`` blob lies, from its first bytes (``head``, which
    must reach the start of the tensor's data) and last bytes (``tail``, which must hold the
    central directory). None when the blob is not a plain single contiguous tensor whose
    storage it is, stored uncompressed (the caller then reads it with ``torch.load``)."""
    entries = _central_entries(tail, blob_length - len(tail))
    if not entries:
        return None
    pickles = [n for n in entries if n.endswith("data.pkl") and n.count("/") == 1]
    if len(pickles) != 1:
        return None
    prefix = pickles[0][: -len("data.pkl")]
    pkl_offset, pkl_size, pkl_method = entries[pickles[0]]
    start = _data_start(head, pkl_offset)
    if pkl_method != 0 or start is None or start + pkl_size > len(head):
        return None
    try:
        desc = _PlainTensorUnpickler(io.BytesIO(bytes(head[start : start + pkl_size]))).load()
    except Exception:  # noqa: BLE001 - any other form (or damage): torch.load decides
        return None
    if not isinstance(desc, _TensorDesc) or desc.offset != 0 or not isinstance(desc.size, tuple):
        return None
    shape = desc.size
    if not all(_is_count(n) for n in shape) or not isinstance(desc.stride, tuple) or len(desc.stride) != len(shape):
        return None
    numel, acc = 1, 1
    for n, s in zip(reversed(shape), reversed(desc.stride)):
        if n != 1 and s != acc:
            return None
        acc *= n
    for n in shape:
        numel *= n
    if numel != desc.storage_numel:
        return None
    record = entries.get(f"{prefix}data/{desc.storage.key}")
    if record is None or record[2] != 0:
        return None
    nbytes = numel * desc.dtype.itemsize
    data_offset = _data_start(head, record[0])
    if data_offset is None or record[1] != nbytes or data_offset + nbytes > blob_length:
        return None
    return StoredTensor(desc.dtype, tuple(shape), data_offset, nbytes)


def layout_signature(head: memoryview, stored: StoredTensor) -> bytes:
    """A blob's bytes before its tensor data with the data record's CRC32 zeroed: blobs with
    equal signatures (and lengths) have the same layout, so ``stored`` holds for all of them."""
    prefix = bytearray(head[: stored.data_offset])
    header = prefix.rfind(struct.pack("<I", _LOCAL_SIG))  # the last local header: the data record's
    if header >= 0:
        prefix[header + _LOCAL_CRC_AT : header + _LOCAL_CRC_AT + 4] = bytes(4)
    return bytes(prefix)


class LayoutCache:
    """Blobs of one load mostly share a few layouts (same dtype and shape, same writer): a
    blob whose bytes up to its tensor data equal those of a blob already located in full
    (the data's CRC field aside) has the same layout, found by one comparison."""

    def __init__(self) -> None:
        self._known: Dict[Tuple[int, bytes], StoredTensor] = {}
        self._lock = threading.Lock()

    def known(self, length: int) -> List[StoredTensor]:
        """The layouts located so far of blobs ``length`` bytes long."""
        return [stored for (known_length, _), stored in list(self._known.items()) if known_length == length]

    def locate(self, head: memoryview, tail: memoryview, length: int) -> Optional[StoredTensor]:
        for (known_length, signature), known in list(self._known.items()):
            if known_length == length and len(head) >= len(signature) and layout_signature(head, known) == signature:
                return known
        stored = locate_tensor_data(head, tail, length)
        if stored is not None and stored.data_offset <= len(head) and len(self._known) < 64:
            with self._lock:
                self._known[(length, layout_signature(head, stored))] = stored
        return stored

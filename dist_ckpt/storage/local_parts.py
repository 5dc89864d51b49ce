"""One rank's part of a local checkpoint: a single file, written exclusively, renamed when
complete, every byte covered by a checksum, read back only after verification.

The local tier (``dist_ckpt.local``) keeps the newest few iterations of each rank's state on
node-local storage or tmpfs, and copies of its peers' parts. A restart trusts these files only
as far as they verify: a torn write, a bit flipped on a RAM disk or in transfer, a file cut
short by a full disk - each is found here and reported as ``CorruptCheckpointError``, so the
caller treats the part as missing (another replica, then the persistent tier) instead of
training on bad values (Megatron-LM issue 5281: NaN losses three steps after a restart from a
silently bad replica).

Layout (little-endian), chosen so a reader can verify without trusting anything first::

    b"DCKLOCAL" u32 version u32 reserved          16 bytes
    tensor bytes, each at a 64-byte aligned offset  (views on load, no second copy)
    state: torch.save(<the state without its tensors>)
    table: JSON {"state": [offset, length, xxh3], "tensors": [[dtype, shape, offset, length, xxh3], ...]}
    trailer: u64 table offset, u64 table length, u64 xxh3 of the table, b"DCKLOCAL"

Verification reads JSON and hashes bytes, nothing is unpickled before every checksum matched;
the state is then unpickled with dist_ckpt's allowlist plus the classes the caller names.
Checksums are ``integrity.manifest``'s xxh3.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..core import CheckpointExistsError, CorruptCheckpointError
from ..integrity.manifest import hash_bytes, new_hasher
from ..integrity.safe_unpickle import safe_torch_load

__all__ = [
    "DIRTY_SUFFIX",
    "PartFile",
    "write_part",
    "read_part",
    "Destination",
    "PartReceiver",
    "remove_part",
]

MAGIC = b"DCKLOCAL"
VERSION = 1
DIRTY_SUFFIX = ".dirty"  # a part being written; never read, removed by cleanup
_PREAMBLE = struct.Struct("<8sII")
_TRAILER = struct.Struct("<QQQ8s")
_ALIGN = 64


@dataclass(frozen=True)
class PartFile:
    """A part as written: where, how many bytes, and the xxh3 of all of them (for transfers)."""

    path: Path
    size: int
    digest: int


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    flat = tensor.detach().cpu().contiguous().view(-1)
    if flat.numel() == 0:
        return memoryview(b"")
    return flat.view(torch.uint8).numpy().data


class _HashingFile:
    """Writes through to a file and hashes everything written (the transfer digest)."""

    def __init__(self, raw: Any) -> None:
        self.raw = raw
        self.pos = 0
        self.hasher = new_hasher()

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        self.raw.write(view)
        self.hasher.update(view)
        self.pos += len(view)
        return len(view)

    def pad_to(self, offset: int) -> None:
        if offset > self.pos:
            self.write(bytes(offset - self.pos))


def write_part(path: Path, state: Any, tensors: Sequence[torch.Tensor]) -> PartFile:
    """Write ``state`` (anything ``torch.save`` pickles; its tensors taken out beforehand) and
    ``tensors`` to ``path``: first to ``path + ".dirty"``, opened exclusively (a second writer
    of the same part fails with ``CheckpointExistsError`` instead of interleaving), renamed to
    ``path`` once complete. Not fsynced: the local tier survives process death through the
    page cache or tmpfs, and node loss through replicas; a torn file is caught by the checksums.
    """
    path = Path(path)
    dirty = path.with_name(path.name + DIRTY_SUFFIX)
    if path.exists():
        raise CheckpointExistsError(f"local checkpoint part {path} already exists; it is not overwritten")
    try:
        raw = open(dirty, "xb")
    except FileExistsError:
        raise CheckpointExistsError(
            f"{dirty} exists: another save of this part is in progress (or was interrupted; "
            f"the manager's cleanup removes it)"
        ) from None
    try:
        with raw:
            out = _HashingFile(raw)
            out.write(_PREAMBLE.pack(MAGIC, VERSION, 0))
            tensor_table = []
            for tensor in tensors:
                data = _as_bytes(tensor)
                out.pad_to(_aligned(out.pos))
                offset = out.pos
                out.write(data)
                tensor_table.append([str(tensor.dtype).replace("torch.", ""), list(tensor.shape), offset, len(data),
                                     hash_bytes(data)])
            state_sink = _Collect()
            torch.save(state, state_sink)  # type: ignore[arg-type]  # a write-only sink
            state_bytes = state_sink.getvalue()
            state_entry = [out.pos, len(state_bytes), hash_bytes(state_bytes)]
            out.write(state_bytes)
            table = json.dumps({"state": state_entry, "tensors": tensor_table}).encode()
            table_offset = out.pos
            out.write(table)
            out.write(_TRAILER.pack(table_offset, len(table), int(hash_bytes(table), 16), MAGIC))
            size, digest = out.pos, out.hasher.intdigest()
        _publish(dirty, path)
    except BaseException:
        _unlink_quietly(dirty)
        raise
    return PartFile(path, size, digest)


def _publish(dirty: Path, path: Path) -> None:
    """Give the complete ``dirty`` file its final name, never replacing a part another writer
    published meanwhile (a hard link fails if the name exists; a rename would replace it)."""
    try:
        os.link(dirty, path)
    except FileExistsError:
        raise CheckpointExistsError(f"local checkpoint part {path} was written by another writer meanwhile; "
                                    f"it is kept, this copy is dropped") from None
    except OSError:  # a file system without hard links: the rename, after a last look
        if path.exists():
            raise CheckpointExistsError(f"local checkpoint part {path} was written by another writer meanwhile")
        os.rename(dirty, path)
        return
    os.unlink(dirty)


class _Collect:
    """A write-only byte sink for torch.save (a BytesIO without the seek torch does not need)."""

    def __init__(self) -> None:
        self._chunks: List[bytes] = []

    def write(self, data: Any) -> int:
        chunk = bytes(data)
        self._chunks.append(chunk)
        return len(chunk)

    def flush(self) -> None:
        pass

    def getvalue(self) -> bytes:
        return b"".join(self._chunks)


Destination = Callable[[Any, int, torch.dtype, Tuple[int, ...]], Optional[torch.Tensor]]


def read_part(path: Path, allowed_globals: Iterable[Any] = (),
              destination: Optional[Destination] = None) -> Tuple[Any, List[torch.Tensor]]:
    """(state, tensors) of a part file, every byte verified; ``CorruptCheckpointError`` names
    what is wrong.

    ``destination(state, i, dtype, shape)`` may name where tensor ``i`` goes (a contiguous CPU
    tensor of that dtype and shape, e.g. the model's own): its bytes are then read straight into
    it, one copy from the page cache or tmpfs, and verified there (if they fail, that tensor
    holds the damaged bytes and the error is raised). Other tensors get fresh memory."""
    where = str(path)
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size

        def read_at(offset: int, length: int) -> memoryview:
            buffer = memoryview(bytearray(length))
            _pread_into(fd, buffer, offset, where)
            return buffer

        table = _frame(size, read_at, where)
        offset, length, digest = table["state"]
        state_bytes = read_at(offset, length)
        if hash_bytes(state_bytes) != digest:
            raise CorruptCheckpointError(f"local checkpoint part {where}: the state ({length} bytes at offset "
                                         f"{offset}) fails its checksum")
        state = _unpickle_state(bytes(state_bytes), where, allowed_globals)
        tensors = []
        for i, (dtype_name, shape, offset, nbytes, digest) in enumerate(table["tensors"]):
            dtype, shape = getattr(torch, dtype_name), tuple(shape)
            target = destination(state, i, dtype, shape) if destination is not None else None
            if target is None or not _fits(target, dtype, shape):
                target = torch.empty(shape, dtype=dtype)
            view = _writable_bytes(target)
            _pread_into(fd, view, offset, where)
            if hash_bytes(view) != digest:
                raise CorruptCheckpointError(f"local checkpoint part {where}: tensor {i} ({nbytes} bytes at offset "
                                             f"{offset}) fails its checksum")
            tensors.append(target)
    return state, tensors


def _fits(tensor: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...]) -> bool:
    return (tensor.dtype == dtype and tuple(tensor.shape) == shape and tensor.device.type == "cpu"
            and tensor.is_contiguous())


def _writable_bytes(tensor: torch.Tensor) -> memoryview:
    if tensor.numel() == 0:
        return memoryview(bytearray())
    return tensor.detach().view(-1).view(torch.uint8).numpy().data


def _pread_into(fd: int, view: memoryview, offset: int, where: str) -> None:
    got = 0
    while got < len(view):
        n = os.preadv(fd, [view[got:]], offset + got)
        if n <= 0:
            raise CorruptCheckpointError(f"local checkpoint part {where} is truncated (no bytes at offset "
                                         f"{offset + got})")
        got += n


def _frame(size: int, read_at: Callable[[int, int], Any], where: str) -> Dict[str, Any]:
    """The table of a part of ``size`` bytes, after checking its framing and the table's checksum
    and that every range it names lies inside the data."""
    what = f"local checkpoint part {where}"
    if size < _PREAMBLE.size + _TRAILER.size:
        raise CorruptCheckpointError(f"{what} is truncated ({size} bytes)")
    magic, version, _ = _PREAMBLE.unpack_from(read_at(0, _PREAMBLE.size), 0)
    table_offset, table_len, table_digest, tail = _TRAILER.unpack_from(read_at(size - _TRAILER.size, _TRAILER.size), 0)
    if magic != MAGIC or tail != MAGIC:
        raise CorruptCheckpointError(f"{what} is not a complete dist_ckpt local part (truncated or overwritten)")
    if version != VERSION:
        raise CorruptCheckpointError(f"{what} has format version {version}; this dist_ckpt reads {VERSION}")
    if table_offset + table_len != size - _TRAILER.size:
        raise CorruptCheckpointError(f"{what} has an inconsistent trailer")
    raw_table = read_at(table_offset, table_len)
    if int(hash_bytes(raw_table), 16) != table_digest:
        raise CorruptCheckpointError(f"{what}: its table fails its checksum")
    try:
        table = json.loads(bytes(raw_table))
        ranges = [table["state"]] + [entry[2:] for entry in table["tensors"]]
        outside = any(offset < _PREAMBLE.size or offset + length > table_offset for offset, length, _ in ranges)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{what}: its table cannot be read ({e})") from None
    if outside:
        raise CorruptCheckpointError(f"{what}: its table names bytes outside the data")
    return table


def _unpickle_state(state_bytes: bytes, where: str, allowed_globals: Iterable[Any]) -> Any:
    return safe_torch_load(state_bytes, what=f"the state in local checkpoint part {where}",
                           extra_globals=allowed_globals)


def _unlink_quietly(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def remove_part(path: Path) -> None:
    """Remove a part (or its ``.dirty`` file); gone already is fine."""
    _unlink_quietly(Path(path))


class PartReceiver:
    """A part arriving in pieces (from a peer): written to ``.dirty`` exclusively, renamed into
    place only when every byte arrived and the digest over them equals the sender's."""

    def __init__(self, path: Path, size: int) -> None:
        self.path = Path(path)
        self.size = size
        self._dirty = self.path.with_name(self.path.name + DIRTY_SUFFIX)
        if self.path.exists():
            raise CheckpointExistsError(f"local checkpoint part {self.path} already exists; it is not overwritten")
        try:
            self._file = open(self._dirty, "xb")
        except FileExistsError:
            raise CheckpointExistsError(f"{self._dirty} exists: another copy of this part is being received") from None
        self._hasher = new_hasher()
        self._received = 0

    def write(self, chunk: memoryview) -> None:
        self._file.write(chunk)
        self._hasher.update(chunk)
        self._received += len(chunk)

    def finish(self, digest: int) -> bool:
        """Rename into place if complete and intact; otherwise remove it. True if kept."""
        self._file.close()
        if self._received == self.size and self._hasher.intdigest() == digest:
            try:
                _publish(self._dirty, self.path)
                return True
            except BaseException:
                _unlink_quietly(self._dirty)
                raise
        _unlink_quietly(self._dirty)
        return False

    def abort(self) -> None:
        self._file.close()
        _unlink_quietly(self._dirty)

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
    tensor bytes, each at a 64-byte aligned offset  (read straight into the model's tensors)
    the state's own tensors' bytes, the same way    (tensors left in the common state, RNG states)
    state: pickle protocol 5 of the state without its tensors, each tensor a persistent id
    table: JSON {"state": [offset, length, xxh3],
                 "tensors": [[dtype, shape, offset, length, xxh3], ...],
                 "state_tensors": [[dtype, shape, offset, length, xxh3, kind, device], ...]}
    (``device``: where the tensor was, e.g. "cuda:0"; it comes back there when that device
    exists, else on the CPU. Parts without it come back on the CPU.)
    trailer: u64 table offset, u64 table length, u64 xxh3 of the table, b"DCKLOCAL"

Verification reads JSON and hashes bytes, nothing is unpickled before every checksum matched;
the state is then unpickled by the C unpickler with dist_ckpt's allowlist plus the classes the
caller names (version 1 parts, whose state is a ``torch.save``, by torch's weights-only
unpickler, five times slower for a model's hollow state). Checksums are ``integrity.manifest``'s xxh3.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, cast

import torch

from .._version import __version__
from ..core import CheckpointExistsError, CheckpointingException, CorruptCheckpointError
from ..integrity.manifest import hash_bytes, new_hasher
from ..integrity.safe_unpickle import globals_by_name, plain_pickle_builtins, safe_pickle_load, safe_torch_load
from ..runtime.devices import (DeviceCopies, accelerator_in_use, host_buffer, host_copy, is_host_memory,
                               to_saved_device)

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
VERSION = 3  # 1: the state as a torch.save; 2: state tensors without their device (both still read)
_READABLE_VERSIONS = (1, 2, 3)
_PICKLE_PROTOCOL = 5  # fixed: the same state gives the same bytes
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
    tensor = tensor.detach()
    flat = (tensor.contiguous() if is_host_memory(tensor) else host_copy(tensor)).view(-1)
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


def write_part(path: Path, state: Any, tensors: Sequence[torch.Tensor],
               allowed_globals: Iterable[Any] = ()) -> PartFile:
    """Write ``state`` (picklable; the model's tensors taken out beforehand into ``tensors``,
    any it still holds are stored beside it) and ``tensors`` to ``path``: first to
    ``path + ".dirty"``, opened exclusively (a second writer of the same part fails with
    ``CheckpointExistsError`` instead of interleaving), renamed to ``path`` once complete. Not
    fsynced: the local tier survives process death through the page cache or tmpfs, and node
    loss through replicas; a torn file is caught by the checksums.

    The state is unpickled once here with the allowlist ``read_part`` uses (and
    ``allowed_globals``): a state that a restart could not load fails this save with
    ``UnsafePickleError`` naming the class, instead of failing the restart.
    """
    path = Path(path)
    dirty = path.with_name(path.name + DIRTY_SUFFIX)
    state_bytes, state_tensors = _pickle_state(state)
    _unpickle_state(state_bytes, state_tensors, f"local checkpoint part {path} (checked before writing)",
                    allowed_globals)
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
            tensor_table = [_write_tensor(out, tensor) for tensor in tensors]
            state_tensor_table = [_write_tensor(out, tensor) + [_tensor_kind(tensor), str(tensor.device)]
                                  for tensor in state_tensors]
            state_entry = [out.pos, len(state_bytes), hash_bytes(state_bytes)]
            out.write(state_bytes)
            table = json.dumps({"state": state_entry, "tensors": tensor_table,
                                "state_tensors": state_tensor_table}).encode()
            table_offset = out.pos
            out.write(table)
            out.write(_TRAILER.pack(table_offset, len(table), int(hash_bytes(table), 16), MAGIC))
            size, digest = out.pos, out.hasher.intdigest()
        _publish(dirty, path)
    except BaseException:
        _unlink_quietly(dirty)
        raise
    return PartFile(path, size, digest)


def _write_tensor(out: _HashingFile, tensor: torch.Tensor) -> List[Any]:
    """Append ``tensor``'s bytes at the next aligned offset; its table entry."""
    data = _as_bytes(tensor)
    out.pad_to(_aligned(out.pos))
    offset = out.pos
    out.write(data)
    return [str(tensor.dtype).replace("torch.", ""), list(tensor.shape), offset, len(data), hash_bytes(data)]


# How a tensor left in the state comes back: its class and whether it requires grad.
_KINDS = {"tensor": (False, False), "tensor_grad": (False, True), "parameter": (True, False),
          "parameter_grad": (True, True)}


def _tensor_kind(tensor: torch.Tensor) -> str:
    parameter = isinstance(tensor, torch.nn.Parameter)
    return next(k for k, v in _KINDS.items() if v == (parameter, tensor.requires_grad))


class _StatePickler(pickle.Pickler):
    """Pickles the state with every tensor in it taken out (a persistent id: its index among
    the state's tensors), so the state unpickles with the C unpickler and an allowlist of plain
    classes, and its tensors are stored and verified like the model's."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=_PICKLE_PROTOCOL)
        self.tensors: List[torch.Tensor] = []

    def persistent_id(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            self.tensors.append(obj)
            return len(self.tensors) - 1
        return None


def _pickle_state(state: Any) -> Tuple[bytes, List[torch.Tensor]]:
    buffer = io.BytesIO()
    pickler = _StatePickler(buffer)
    try:
        pickler.dump(state)
    except (pickle.PicklingError, TypeError, AttributeError) as e:
        raise CheckpointingException(f"the state cannot be saved in the local tier: it does not pickle ({e})") from e
    return buffer.getvalue(), pickler.tensors


def _unpickle_state(state_bytes: bytes, tensors: Sequence[torch.Tensor], what: str,
                    allowed_globals: Iterable[Any]) -> Any:
    """The state of a version 2 part (its tensors already read and verified)."""

    def tensor(pid: Any) -> torch.Tensor:
        if not isinstance(pid, int) or not 0 <= pid < len(tensors):
            raise pickle.UnpicklingError(f"persistent id {pid!r} names no tensor of the part")
        return tensors[pid]

    allowed = {**plain_pickle_builtins(), **_STATE_BUILTINS, **globals_by_name(allowed_globals)}
    return safe_pickle_load(io.BytesIO(state_bytes), what, allowed, persistent_load=tensor)


# Bounded constructors a state's containers use (``defaultdict(list)``), and torch devices.
_STATE_BUILTINS: Dict[str, Any] = {f"builtins.{t.__name__}": t for t in (list, dict, tuple, int, float, str, bool)}
_STATE_BUILTINS["torch.device"] = torch.device


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


Destination = Callable[[Any, int, torch.dtype, Tuple[int, ...]], Optional[torch.Tensor]]


def read_part(path: Path, allowed_globals: Iterable[Any] = (),
              destination: Optional[Destination] = None) -> Tuple[Any, List[torch.Tensor]]:
    """(state, tensors) of a part file, every byte verified; ``CorruptCheckpointError`` names
    what is wrong.

    ``destination(state, i, dtype, shape)`` may name where tensor ``i`` goes (a tensor of that
    dtype and shape, e.g. the model's own): a contiguous one in host memory gets its bytes read
    straight into it, one copy from the page cache or tmpfs, and verified there (if they fail,
    that tensor holds the damaged bytes and the error is raised); one in device memory gets them
    through a reused host buffer, verified before they are copied in, so restoring a GPU state
    needs no second copy of it on the GPU. Other tensors get fresh host memory."""
    where = str(path)
    staging = _DeviceStaging()
    with open(path, "rb") as f:
        fd = f.fileno()
        size = os.fstat(fd).st_size

        def read_at(offset: int, length: int) -> memoryview:
            buffer = memoryview(bytearray(length))
            _pread_into(fd, buffer, offset, where)
            return buffer

        def read_tensor(what: str, entry: List[Any], target: Optional[torch.Tensor]) -> torch.Tensor:
            dtype_name, shape, offset, nbytes, digest = entry[:5]
            dtype, shape = getattr(torch, dtype_name), tuple(shape)
            if target is None or not _fits(target, dtype, shape):
                target = None
            into_device = target is not None and not is_host_memory(target)
            host = torch.empty(shape, dtype=dtype) if target is None or into_device else target
            if into_device:  # through one reused host buffer, verified there, then copied
                host = staging.buffer(host)
            view = _writable_bytes(host)
            _pread_into(fd, view, offset, where)
            if hash_bytes(view) != digest:
                raise CorruptCheckpointError(f"local checkpoint part {where}: {what} ({nbytes} bytes at offset "
                                             f"{offset}) fails its checksum")
            if into_device:
                staging.copy(cast(torch.Tensor, target), host)
                return cast(torch.Tensor, target)
            return host

        version, table = _frame(size, read_at, where)
        offset, length, digest = table["state"]
        state_bytes = read_at(offset, length)
        if hash_bytes(state_bytes) != digest:
            raise CorruptCheckpointError(f"local checkpoint part {where}: the state ({length} bytes at offset "
                                         f"{offset}) fails its checksum")
        what = f"the state in local checkpoint part {where}"
        if version == 1:
            state = safe_torch_load(bytes(state_bytes), what=what, extra_globals=allowed_globals)
        else:
            state_tensors = [to_saved_device(_as_kind(read_tensor(f"state tensor {i}", entry, None), entry[5], where),
                                             entry[6] if version >= 3 else None)
                             for i, entry in enumerate(table["state_tensors"])]
            state = _unpickle_state(bytes(state_bytes), state_tensors, what, allowed_globals)
        tensors = []
        for i, entry in enumerate(table["tensors"]):
            dtype, shape = getattr(torch, entry[0]), tuple(entry[1])
            target = destination(state, i, dtype, shape) if destination is not None else None
            tensors.append(read_tensor(f"tensor {i}", entry, target))
    return state, tensors


def _as_kind(tensor: torch.Tensor, kind: Any, where: str) -> torch.Tensor:
    if kind not in _KINDS:
        raise CorruptCheckpointError(f"local checkpoint part {where}: unknown tensor kind {kind!r}")
    parameter, requires_grad = _KINDS[kind]
    if parameter:
        return torch.nn.Parameter(tensor, requires_grad=requires_grad)
    return tensor.requires_grad_(requires_grad)


def _fits(tensor: torch.Tensor, dtype: torch.dtype, shape: Tuple[int, ...]) -> bool:
    """Whether a destination takes the tensor as stored: same dtype and shape, and (host memory,
    read straight into) contiguous, or in device memory (copied in from a host buffer)."""
    return (tensor.dtype == dtype and tuple(tensor.shape) == shape
            and (tensor.is_contiguous() or not is_host_memory(tensor)))


class _DeviceStaging:
    """The host buffer that tensors bound for device memory are read into and verified in, one at
    a time, then copied to their destination: peak device memory stays the destinations, and
    host memory one tensor (grown to the largest). Each copy finishes before the buffer is reused."""

    def __init__(self) -> None:
        self._memory = torch.empty(0, dtype=torch.uint8)
        self._copies = DeviceCopies()

    def buffer(self, like: torch.Tensor) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        if self._memory.numel() < nbytes:
            self._memory = host_buffer(nbytes, accelerator_in_use())
        return self._memory[:nbytes].view(like.dtype).view(like.shape)

    def copy(self, target: torch.Tensor, host: torch.Tensor) -> None:
        with torch.no_grad():
            self._copies.copy(target.detach(), host)
        self._copies.wait()


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


def _frame(size: int, read_at: Callable[[int, int], Any], where: str) -> Tuple[int, Dict[str, Any]]:
    """(format version, table) of a part of ``size`` bytes, after checking its framing and the
    table's checksum and that every range it names lies inside the data."""
    what = f"local checkpoint part {where}"
    if size < _PREAMBLE.size + _TRAILER.size:
        raise CorruptCheckpointError(f"{what} is truncated ({size} bytes)")
    magic, version, _ = _PREAMBLE.unpack_from(read_at(0, _PREAMBLE.size), 0)
    table_offset, table_len, table_digest, tail = _TRAILER.unpack_from(read_at(size - _TRAILER.size, _TRAILER.size), 0)
    if magic != MAGIC or tail != MAGIC:
        raise CorruptCheckpointError(f"{what} is not a complete dist_ckpt local part (truncated or overwritten)")
    if version not in _READABLE_VERSIONS:
        # no hash covers the preamble: a newer writer and a damaged byte look alike, and either
        # way the tier takes the part from a peer or the persistent tier
        raise CorruptCheckpointError(f"{what} has format version {version}, which this dist_ckpt ({__version__}) "
                                     f"does not read (it reads {', '.join(map(str, _READABLE_VERSIONS))}): written "
                                     f"by a newer dist_ckpt, or damaged")
    if table_offset + table_len != size - _TRAILER.size:
        raise CorruptCheckpointError(f"{what} has an inconsistent trailer")
    raw_table = read_at(table_offset, table_len)
    if int(hash_bytes(raw_table), 16) != table_digest:
        raise CorruptCheckpointError(f"{what}: its table fails its checksum")
    try:
        table = json.loads(bytes(raw_table))
        table.setdefault("state_tensors", [])  # version 1 stored them in its torch.save
        for entry in table["tensors"]:
            _check_tensor_entry(entry, 5)
        for entry in table["state_tensors"]:
            _check_tensor_entry(entry, 7 if version >= 3 else 6)
        ranges = [table["state"]] + [entry[2:5] for entry in table["tensors"] + table["state_tensors"]]
        outside = any(offset < _PREAMBLE.size or offset + length > table_offset for offset, length, _ in ranges)
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptCheckpointError(f"{what}: its table cannot be read ({e})") from None
    if outside:
        raise CorruptCheckpointError(f"{what}: its table names bytes outside the data")
    return version, table


def _check_tensor_entry(entry: Any, fields: int) -> None:
    """A tensor's table entry names a torch dtype and a shape whose size is its byte count
    (so a reader allocates only what the file holds); ValueError otherwise."""
    if not isinstance(entry, list) or len(entry) != fields:
        raise ValueError(f"a tensor entry is not a list of {fields} fields: {entry!r}")
    dtype = getattr(torch, entry[0], None) if isinstance(entry[0], str) else None
    shape = entry[1]
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{entry[0]!r} is not a torch dtype")
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 0 for n in shape):
        raise ValueError(f"{shape!r} is not a shape")
    numel = 1
    for n in shape:
        numel *= n
    if numel * dtype.itemsize != entry[3]:
        raise ValueError(f"a {entry[0]} tensor of shape {shape} does not have {entry[3]} bytes")


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

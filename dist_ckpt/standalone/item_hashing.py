"""Checksums of items as they are written: xxh3-64 over each item, and over a large tensor's
data in blocks too (``BlockHashes``), computed while the bytes pass on their way to the file
(``HashingWriter``: no second pass over the data).

The training process (``integrity.recording``, which re-exports these) and the writer process
(``plain_files``) hash with this one implementation, so their manifests agree.
"""

from __future__ import annotations

from typing import IO, Any, List, NamedTuple, Optional, Tuple, Union

import xxhash

__all__ = [
    "HASH_ALGORITHM",
    "MIN_BLOCK_BYTES",
    "MAX_BLOCKS",
    "hash_bytes",
    "new_hasher",
    "block_bytes_for",
    "BlockHashes",
    "HashingWriter",
]

HASH_ALGORITHM = "xxh3_64"


def hash_bytes(data: Union[bytes, bytearray, memoryview]) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def new_hasher() -> "xxhash.xxh3_64":
    """An incremental hasher of ``HASH_ALGORITHM`` (``update(bytes)``, ``hexdigest()``), for
    code that hashes a range piece by piece; the algorithm is named here only."""
    return xxhash.xxh3_64()


MIN_BLOCK_BYTES = 1 << 20  # a tensor's data of at least 2 such blocks is hashed in blocks too...
MAX_BLOCKS = 32  # ...of a power of two in size, at most this many per item


def block_bytes_for(nbytes: int) -> Optional[int]:
    """The block size ``nbytes`` of tensor data are hashed in; None: hashed whole only (a
    reader reads it whole). A partial read costs at most 2 blocks more than it needs (1/16 of
    the chunk); an item adds at most 34 hashes to the manifest."""
    if nbytes < 2 * MIN_BLOCK_BYTES:
        return None
    block = MIN_BLOCK_BYTES
    while block * MAX_BLOCKS < nbytes:
        block *= 2
    return block


class BlockHashes(NamedTuple):
    """An entry's bytes as segments, each hashed: ``hashes[0]`` covers the ``data_start`` bytes
    before the tensor's data (a blob's zip headers and pickle), then one hash per ``block_bytes``
    of the ``data_length`` data bytes (the last block may be shorter), then ``hashes[-1]`` the
    bytes after the data. The entry's own ``hash`` still covers the whole range."""

    data_start: int
    data_length: int
    block_bytes: int
    hashes: Tuple[str, ...]

    def block_count(self) -> int:
        return -(-self.data_length // self.block_bytes)


class HashingWriter:
    """A write-only file wrapper that hashes what passes through, item by item.

    ``start_item()`` begins a new hashed range; ``finish_item()`` returns (offset, length,
    hash) of the bytes written since. Writes go straight to the file object (no copy here; the
    file may gather small writes in its buffer). An item's writer that calls
    ``expect_data(data_start, nbytes)`` first (the item's data will be its ``nbytes`` bytes from
    ``data_start``) also gets the item's ``BlockHashes`` (``last_blocks``, after
    ``finish_item``) when the data is large.
    """

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self._pos = raw.tell()
        self._start = self._pos
        self._hasher = new_hasher()
        self._blocks: Optional[_BlockHasher] = None
        self.last_blocks: Optional[BlockHashes] = None
        self.error: Optional[OSError] = None  # torch.save hides its writer's errors; we keep them

    def write(self, data: Any) -> int:
        view = memoryview(data).cast("B")
        if self._blocks is not None:
            self._blocks.update(view, self._hasher)  # both hashes, block by block (in cache)
        else:
            self._hasher.update(view)
        written = self._write_raw(view)
        return written if written is not None else len(view)

    def _write_raw(self, view: Any) -> Optional[int]:
        """Write to the file unhashed, keeping the first error (torch.save hides it)."""
        try:
            written = self._raw.write(view)
        except OSError as e:
            self.error = self.error or e
            raise
        self._pos += len(view)
        return written

    def tell(self) -> int:
        return self._pos

    def flush(self) -> None:
        self._raw.flush()

    def fileno(self) -> int:
        return self._raw.fileno()

    def start_item(self, align: int = 1) -> None:
        """Begin an item at the next multiple of ``align`` bytes (zeros before it, in no item)."""
        padding = -self._pos % align
        if padding:
            self._write_raw(bytes(padding))
        self._start = self._pos
        self._hasher.reset()
        self._blocks = None
        self.last_blocks = None

    def expect_data(self, data_start: int, nbytes: int) -> None:
        """Before the item's first write: its bytes ``[data_start, data_start + nbytes)`` are
        a tensor's data, hashed in blocks too if large."""
        block = block_bytes_for(nbytes)
        if block is not None and self._pos == self._start:
            self._blocks = _BlockHasher(data_start, nbytes, block)

    def write_item(self, data: bytes, align: int = 1) -> Tuple[int, int, str]:
        """``start_item(align)``, ``write(data)`` and ``finish_item()`` of a whole item in hand,
        hashed in one call: the per-item cost of a rank of 10^5 small tensors."""
        self.start_item(align)
        start = self._start
        self._write_raw(data)
        return start, len(data), hash_bytes(data)

    def finish_item(self) -> Tuple[int, int, str]:
        if self._blocks is not None:
            self.last_blocks = self._blocks.finish()
            self._blocks = None
        return self._start, self._pos - self._start, self._hasher.hexdigest()


class _BlockHasher:
    """The segments of one item (``BlockHashes``) as its bytes pass, cut by position: the head
    (``data_start`` bytes), the data's blocks, the tail (whatever follows the data)."""

    def __init__(self, data_start: int, data_length: int, block_bytes: int) -> None:
        self.data_start, self.data_length, self.block_bytes = data_start, data_length, block_bytes
        self._segment = new_hasher()
        self._hashes: List[str] = []
        self._pos = 0  # bytes of the item seen
        self._data_end = data_start + data_length

    def _boundary(self) -> Optional[int]:
        """Where the current segment ends (None: the tail, which ends with the item)."""
        if self._pos < self.data_start:
            return self.data_start
        if self._pos < self._data_end:
            return min(self._data_end, self._pos + self.block_bytes - (self._pos - self.data_start) % self.block_bytes)
        return None

    def update(self, view: memoryview, item_hasher: Any) -> None:
        while len(view):
            boundary = self._boundary()
            piece = view if boundary is None else view[: boundary - self._pos]
            item_hasher.update(piece)  # both hashes of a piece while it is in cache
            self._segment.update(piece)
            self._pos += len(piece)
            if self._pos == boundary:
                self._hashes.append(self._segment.hexdigest())
                self._segment.reset()
            view = view[len(piece):]

    def finish(self) -> Optional[BlockHashes]:
        """The item's block hashes; None if it ended before its data did (not a blocked item)."""
        if self._pos < self._data_end:
            return None
        return BlockHashes(self.data_start, self.data_length, self.block_bytes,
                           (*self._hashes, self._segment.hexdigest()))

"""Checksums of everything a checkpoint holds: computed while writing, verified while reading.

Every writer (torch_dist items, zarr chunks and ``.zarray`` files, ``common.pt``, object files,
``.metadata``) hashes the bytes as it writes them (xxh3-64, no second pass over the data) and
adds an entry ``(file, offset, length, hash, key)`` to the save's ``Recorder`` (that writing
side is ``integrity.recording``; its names are re-exported here). The
coordinator gathers all ranks' entries when it commits and writes ``dist_ckpt_manifest.json``
beside ``metadata.json`` (a file of its own, so Megatron-Core still reads the checkpoint).

Readers check each byte range they read against the manifest (``verify_bytes``), unless
``load(..., verify_checksums=False)``. Checkpoints without a manifest (Megatron-Core's, older
ones) load with the check skipped and logged.

A large tensor's entry also hashes its data in blocks (``BlockHashes``, ``block_bytes_for``;
manifest version 3): a resharding load that needs a part of a stored chunk reads and verifies
the blocks that part lies in instead of the whole chunk (loading 2 ranks' chunks on 4 ranks,
each rank read 540 MiB for the 270 it needed; now 432, the rest being column halves, which
span every row of their chunk).
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import logging
import os
import pickle
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Tuple, Union, cast

from .._version import __version__
from ..core import CorruptCheckpointError, UnsupportedFormatError
from ..runtime.durable import atomic_write_bytes
from ..runtime.file_cache import ParsedFileCache
from ..runtime.gc_pause import gc_paused
from .recording import (  # the writing side, re-exported: callers import them from here too
    HASH_ALGORITHM,
    BlockHashes,
    HashingWriter,
    ManifestEntry,
    Recorder,
    block_bytes_for,
    forget_recorder,
    hash_bytes,
    new_hasher,
    open_recorder,
    recorder_for,
)

logger = logging.getLogger(__name__)

__all__ = [
    "MANIFEST_FNAME",
    "HASH_ALGORITHM",
    "ManifestEntry",
    "BlockHashes",
    "block_bytes_for",
    "Manifest",
    "ManifestPart",
    "PartsToSend",
    "Recorder",
    "HashingWriter",
    "open_recorder",
    "recorder_for",
    "forget_recorder",
    "hash_bytes",
    "new_hasher",
    "load_manifest",
    "manifest_given",
    "write_manifest",
    "manifest_bytes",
    "update_manifest",
    "verification",
    "verification_enabled",
    "verify_bytes",
    "expected_entry",
    "check_digest",
    "entry_is_intact",
    "block_mismatch",
    "read_verified",
]

MANIFEST_FNAME = "dist_ckpt_manifest.json"
MANIFEST_FORMAT = "dist_ckpt-manifest"
# 4: the document ends with ``"manifest_hash"``, the hash of every byte before that field (its
# own damage - a block hash, a key label - is found as such, not blamed on the data).
# 3: an entry may have a sixth field, its BlockHashes.
# 2: entries as [file, offset, length, hash, key] arrays; 1 (dicts) is still read
MANIFEST_VERSION = 4
_READABLE_VERSIONS = (1, 2, 3, 4)
_SELF_HASH_FIELD = b',"manifest_hash":"'
_SELF_HASH_FIELD_LENGTH = len(_SELF_HASH_FIELD) + 16 + 2  # the field, its 16 hex digits, '"}' 
# ~60 bytes an entry: room for tens of millions of entries (one per item of every rank)
_MAX_MANIFEST_BYTES = 4 << 30


# -- the manifest file -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Manifest:
    """The entries of a manifest by (file, offset) and by file. A ``partial`` one holds only
    some files' entries (``part``: what a load's coordinator sends a rank): a range it does not
    list is looked up in the whole manifest, never taken as unlisted."""

    entries: Dict[Tuple[str, int], ManifestEntry]
    files: Dict[str, List[ManifestEntry]]
    partial: bool = False
    #: the file's own hash did not match its content (version 4): its hashes may be wrong
    damaged: bool = False

    @classmethod
    def from_entries(cls, entries: List[ManifestEntry], partial: bool = False, damaged: bool = False) -> "Manifest":
        by_range: Dict[Tuple[str, int], ManifestEntry] = {}
        files: Dict[str, List[ManifestEntry]] = {}
        for e in entries:
            by_range[(e.file, e.offset)] = e
            files.setdefault(e.file, []).append(e)
        return cls(by_range, files, partial, damaged)

    def part(self, files: Iterable[str], ranges: Iterable[Tuple[str, int]] = ()) -> "Manifest":
        """A partial manifest with the entries of ``files`` (those this manifest lists) and those
        at ``ranges`` ((file, offset) each; those it lists)."""
        chosen = [e for f in set(files) for e in self.files.get(f, ())]
        chosen += [e for e in map(self.entries.get, set(ranges)) if e is not None]
        return Manifest.from_entries(chosen, partial=True)

    def lookup(self, file: str, offset: int) -> Optional[ManifestEntry]:
        return self.entries.get((file, offset))

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        """Pickled as one list of plain tuples (what a load's coordinator sends each rank): the
        named tuples and both tables took ~1 ms per rank's part of ~430 entries, 16 s for 16,384
        ranks (``benchmarks/simulate_scale.py``); the receiver builds the tables again."""
        return _manifest_from_rows, ([_plain_row(e) for e in self.entries.values()], self.partial)


class PartsToSend:
    """Parts of one manifest as a load's coordinator sends them to ranks (``part``): each entry's
    row is pickled once, when a part first names it, and reused by every part that names it
    again (data-parallel ranks read the same model shards), where pickling every part's entries
    anew took 5 s at 16,384 ranks (``benchmarks/simulate_scale.py``). One per round of parts:
    the pickled rows go when it goes."""

    def __init__(self, manifest: Manifest) -> None:
        self.manifest = manifest
        self.pickled_rows: Dict[Tuple[str, int], bytes] = {}

    def part(self, files: Iterable[str], ranges: Iterable[Tuple[str, int]] = ()) -> "ManifestPart":
        """``manifest.part(files, ranges)``, ready to send: unpickled, it is that partial ``Manifest``."""
        entries, pickled = self.manifest.entries, self.pickled_rows
        keys = [(e.file, e.offset) for f in set(files) for e in self.manifest.files.get(f, ())]
        keys += ranges if isinstance(ranges, (set, frozenset)) else set(ranges)
        rows = []
        for k in keys:
            row = pickled.get(k)
            if row is None:
                entry = entries.get(k)
                if entry is None:  # a range the manifest does not list: the rank's reader refuses it
                    continue
                row = pickled[k] = pickle.dumps(_plain_row(entry), protocol=pickle.HIGHEST_PROTOCOL)
            rows.append(row)
        return ManifestPart(b"".join(rows), len(rows))


class ManifestPart:
    """Some entries of a manifest, their pickled rows one after another (``PartsToSend.part``;
    one bytes object pickles in a copy, a list of shared ones took a memo entry each): a partial
    ``Manifest`` once unpickled (or ``to_manifest``)."""

    __slots__ = ("rows", "count")

    def __init__(self, rows: bytes, count: int) -> None:
        self.rows = rows
        self.count = count

    def to_manifest(self) -> Manifest:
        return _manifest_from_pickled_rows(self.rows, self.count)

    def __reduce__(self) -> Tuple[Any, Tuple[Any, ...]]:
        return _manifest_from_pickled_rows, (self.rows, self.count)


def _plain_row(e: ManifestEntry) -> Tuple[Any, ...]:
    return e[:5] + (None if e.blocks is None else tuple(e.blocks),)


def _manifest_from_pickled_rows(rows: bytes, count: int) -> Manifest:
    """``ManifestPart``'s rows (pickled by this job's load coordinator) as a partial ``Manifest``."""
    unpickler = pickle.Unpickler(io.BytesIO(rows))  # noqa: S301 - made by this job's coordinator
    return _manifest_from_rows([unpickler.load() for _ in range(count)], partial=True)


def _manifest_from_rows(rows: List[Tuple[Any, ...]], partial: bool) -> Manifest:
    """``Manifest.__reduce__``'s rows as a ``Manifest`` again."""
    return Manifest.from_entries([ManifestEntry(row[0], row[1], row[2], row[3], row[4],
                                                None if row[5] is None else BlockHashes(*row[5]))
                                  for row in rows], partial=partial)


def _row(e: ManifestEntry) -> List[Any]:
    row: List[Any] = [e.file, e.offset, e.length, e.hash, e.key]
    if e.blocks is not None:
        b = e.blocks
        row.append([b.data_start, b.data_length, b.block_bytes, list(b.hashes)])
    return row


def write_manifest(checkpoint_dir: Path, entries: List[ManifestEntry]) -> None:
    """One compact JSON document (C encoder, rows not dicts: millions of entries in seconds),
    ending with its own hash (``manifest_bytes``)."""
    atomic_write_bytes(Path(checkpoint_dir) / MANIFEST_FNAME, manifest_bytes(entries))


def manifest_bytes(entries: List[ManifestEntry]) -> bytes:
    """The manifest document: entries sorted by (file, offset), then ``"manifest_hash"``, the
    hash of every byte before that field."""
    rows = sorted((_row(e) for e in entries), key=lambda r: (r[0], r[1]))
    # a data file several ranks hard-linked from an incremental save's base: its entries once
    rows = [row for i, row in enumerate(rows) if i == 0 or row != rows[i - 1]]
    content = {"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, "hash": HASH_ALGORITHM, "entries": rows}
    body = json.dumps(content, separators=(",", ":")).encode()[:-1]  # without its closing brace
    return body + _SELF_HASH_FIELD + hash_bytes(body).encode() + b'"}'


def _self_hash_matches(raw: bytes) -> bool:
    """Whether a version-4 document ends with its own hash, matching the bytes before it."""
    at = len(raw) - _SELF_HASH_FIELD_LENGTH
    if at < 0 or raw[at: at + len(_SELF_HASH_FIELD)] != _SELF_HASH_FIELD or not raw.endswith(b'"}'):
        return False
    return hash_bytes(raw[:at]).encode() == raw[at + len(_SELF_HASH_FIELD): -2]


def _entry_fields(e: Any, version: int) -> Optional[Tuple[Any, ...]]:
    if version == 1:
        if not isinstance(e, dict) or set(e) != {"file", "offset", "length", "hash", "key"}:
            return None
        return (e["file"], e["offset"], e["length"], e["hash"], e["key"])
    if not isinstance(e, list) or not (len(e) == 5 or (version >= 3 and len(e) == 6)):
        return None
    return tuple(e)


def _block_hashes(raw: Any, length: int) -> Optional[BlockHashes]:
    """An entry's sixth field as ``BlockHashes`` if it is well formed and fits the entry's
    ``length``; None otherwise."""
    if not isinstance(raw, list) or len(raw) != 4:
        return None
    data_start, data_length, block_bytes, hashes = raw
    if not (_is_count(data_start) and _is_count(data_length) and _is_count(block_bytes) and block_bytes > 0
            and data_start + data_length <= length and isinstance(hashes, list)):
        return None
    blocks = BlockHashes(data_start, data_length, block_bytes, tuple(hashes))
    if len(hashes) != blocks.block_count() + 2 or not _are_hashes(hashes):
        return None
    return blocks


_HEX = frozenset("0123456789abcdef")


@gc_paused()  # one entry per item of every rank: many small objects, as in an unpickled index
def parse_manifest(raw: bytes, where: str) -> Manifest:
    """Parse manifest bytes strictly; anything malformed is a ``CorruptCheckpointError``."""
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(f"{where} is {len(raw)} bytes, larger than any manifest dist_ckpt writes")
    try:
        content = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CorruptCheckpointError(f"{where} is not valid JSON ({e})") from None
    if not isinstance(content, dict) or content.get("format") != MANIFEST_FORMAT:
        raise CorruptCheckpointError(f"{where} is not a dist_ckpt manifest")
    version = content.get("version")
    if version not in _READABLE_VERSIONS or isinstance(version, bool) or content.get("hash") != HASH_ALGORITHM:
        # a newer dist_ckpt's document, if it ends with its own hash as version 4 does (a damaged
        # version field does not match it)
        newer = type(version) is int and version > MANIFEST_VERSION and _self_hash_matches(raw)
        raise (UnsupportedFormatError if newer else CorruptCheckpointError)(
            f"{where}: manifest version {content.get('version')!r} / hash {content.get('hash')!r} is not "
            f"supported by this dist_ckpt ({__version__}; it reads versions {_READABLE_VERSIONS} / "
            f"{HASH_ALGORITHM})" + ("; a newer dist_ckpt wrote it (not damage): upgrade dist_ckpt" if newer else
                                        "; damaged, or written by a newer dist_ckpt")
        )
    unknown = set(content) - {"format", "version", "hash", "entries"} - ({"manifest_hash"} if version >= 4 else set())
    if unknown:
        raise CorruptCheckpointError(f"{where}: unknown fields {sorted(unknown)}")
    raw_entries = content.get("entries")
    if not isinstance(raw_entries, list):
        raise CorruptCheckpointError(f"{where}: 'entries' must be a list")
    fields = [_entry_fields(raw, version) for raw in raw_entries]
    blocked = [i for i, f in enumerate(fields) if f is not None and len(f) == 6]
    rows = [f if f is None or len(f) == 5 else f[:5] for f in fields] if blocked else fields
    if not _all_well_formed(rows):
        for i, (raw, f) in enumerate(zip(raw_entries, rows)):
            if not _is_well_formed(f):
                raise CorruptCheckpointError(f"{where}: entry {i} is malformed: {str(raw)[:200]}")
    entries = [ManifestEntry(*f) for f in cast(List[Tuple[Any, ...]], rows)]
    for i in blocked:  # few: one per large tensor
        extra = cast(Tuple[Any, ...], fields[i])[5]
        blocks = _block_hashes(extra, entries[i].length)
        if blocks is None:
            raise CorruptCheckpointError(f"{where}: entry {i} has malformed block hashes: {str(extra)[:200]}")
        entries[i] = entries[i]._replace(blocks=blocks)
    # well formed; whether its bytes are the ones written is the self hash's to say (a version 4
    # document rewritten by another tool, even reformatted, no longer ends with a matching one)
    damaged = version >= 4 and not _self_hash_matches(raw)
    if damaged:
        logger.warning("%s is damaged: its own hash (manifest_hash, at its end) does not match its content. Its "
                       "checksums may be wrong: a mismatch is checked against the whole entry before the data is "
                       "blamed; `dist-ckpt validate` reports what else is wrong", where)
    return Manifest.from_entries(entries, damaged=damaged)


def _are_hashes(hashes: List[Any]) -> bool:
    """Whether every one is a 16-digit hex string: checked on their concatenation (a call per
    hash took 1 of the 3 s that parsing a 16,384-rank job's 1.3 M block hashes took)."""
    if not all(isinstance(h, str) for h in hashes) or any(len(h) != 16 for h in hashes):
        return False
    return _HEX.issuperset("".join(hashes))


def _is_well_formed(f: Optional[Tuple[Any, ...]]) -> bool:
    """One entry's fields: a plain relative file name, two counts, a 16-digit hex hash, a key or None."""
    return not (
        f is None
        or not isinstance(f[0], str)
        or not _is_plain_relative(f[0])
        or not _is_count(f[1])
        or not _is_count(f[2])
        or not isinstance(f[3], str)
        or len(f[3]) != 16
        or not _HEX.issuperset(f[3])
        or not (f[4] is None or isinstance(f[4], str))
    )


def _all_well_formed(rows: List[Optional[Tuple[Any, ...]]]) -> bool:
    """``_is_well_formed`` of every row, checked column by column: a checkpoint of N ranks has
    entries for every rank's items, and every rank of a load reads them all, so the per-entry
    checks made each rank's load grow with N (parsing 8,000 entries took 16 ms; these checks now
    take 3 ms of its 9.5). File names repeat (one per data file), so each is checked once."""
    if any(f is None for f in rows):
        return False
    files, offsets, lengths, hashes, keys = zip(*rows) if rows else ((), (), (), (), ())
    return (all(type(name) is str for name in files)
            and all(_is_plain_relative(name) for name in set(files))
            and all(type(v) is int for v in offsets) and all(type(v) is int for v in lengths)
            and (not rows or (0 <= min(offsets) and max(offsets) < _COUNT_LIMIT
                              and 0 <= min(lengths) and max(lengths) < _COUNT_LIMIT))
            and all(type(h) is str and len(h) == 16 for h in hashes) and _HEX.issuperset("".join(hashes))
            and all(k is None or type(k) is str for k in keys))


_COUNT_LIMIT = 1 << 62  # no offset or length of a real checkpoint comes near


def _is_count(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < _COUNT_LIMIT


def _is_plain_relative(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and "\\" not in name and all(p not in ("", ".", "..") for p in parts)


def update_manifest(checkpoint_dir: Path, drop: "Callable[[ManifestEntry], bool]", add: List[ManifestEntry]) -> None:
    """Rewrite the manifest (if there is one) without the entries ``drop`` selects, plus ``add``."""
    manifest = _manifest_on_disk(checkpoint_dir)
    if manifest is None:
        return
    kept = [e for entries in manifest.files.values() for e in entries if not drop(e)]
    write_manifest(Path(checkpoint_dir), kept + add)


_manifest_cache: ParsedFileCache[Manifest] = ParsedFileCache(8)  # per manifest file version
_logged_missing: set = set()


_given: contextvars.ContextVar[Optional[Tuple[str, Manifest]]] = contextvars.ContextVar(
    "dist_ckpt_given_manifest", default=None)


@contextlib.contextmanager
def manifest_given(checkpoint_dir: Union[str, os.PathLike], manifest: Optional[Manifest]) -> Iterator[None]:
    """Inside the block (this thread), ``load_manifest(checkpoint_dir)`` is ``manifest`` (a
    rank's part, from the load's coordinator, which read and checked the whole file once: a
    manifest lists every rank's items, so reading it on every rank made each rank's load grow
    with the number of ranks). None: nothing given, the file is read as usual."""
    token = _given.set(None if manifest is None else (os.path.abspath(checkpoint_dir), manifest))
    try:
        yield
    finally:
        _given.reset(token)


def load_manifest(checkpoint_dir: Union[str, os.PathLike]) -> Optional[Manifest]:
    """The checkpoint's manifest (the part given for it, ``manifest_given``), or None (logged
    once) if it has none."""
    given = _given.get()
    if given is not None and given[0] == os.path.abspath(checkpoint_dir):
        return given[1]
    return _manifest_on_disk(checkpoint_dir)


def _manifest_on_disk(checkpoint_dir: Union[str, os.PathLike]) -> Optional[Manifest]:
    """The whole manifest file, parsed once per version and process."""
    path = Path(checkpoint_dir) / MANIFEST_FNAME
    key = os.path.abspath(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        if key not in _logged_missing:
            _logged_missing.add(key)
            logger.info("%s has no %s (written by Megatron-Core or an older dist_ckpt): checksums not verified",
                        checkpoint_dir, MANIFEST_FNAME)
        return None
    version = (key, st.st_ino, st.st_mtime_ns, st.st_size)
    cached = _manifest_cache.get(version)
    if cached is not None:
        return cached
    if st.st_size > _MAX_MANIFEST_BYTES:  # refused by its size, before reading it
        raise CorruptCheckpointError(f"{path} is {st.st_size} bytes, larger than any manifest dist_ckpt writes")
    manifest = parse_manifest(path.read_bytes(), str(path))
    _manifest_cache.put(version, manifest)
    return manifest


# -- verification -----------------------------------------------------------------------------------

_verify: contextvars.ContextVar[bool] = contextvars.ContextVar("dist_ckpt_verify_checksums", default=True)


@contextlib.contextmanager
def verification(enabled: bool) -> Iterator[None]:
    """Turn checksum verification on or off for the loads inside the block (this thread)."""
    token = _verify.set(enabled)
    try:
        yield
    finally:
        _verify.reset(token)


def verification_enabled() -> bool:
    return _verify.get()


def verify_bytes(checkpoint_dir: Union[str, os.PathLike], file: str, offset: int, data: bytes,
                 what: Optional[str] = None) -> None:
    """Check ``data`` read at ``offset`` of ``file`` against the manifest (if any)."""
    if not verification_enabled():
        return
    manifest = load_manifest(checkpoint_dir)
    if manifest is None:
        return
    entry = expected_entry(manifest, checkpoint_dir, file, offset, what)
    check_digest(checkpoint_dir, file, offset, entry, len(data), hash_bytes(data), what)


def expected_entry(manifest: Manifest, checkpoint_dir: Union[str, os.PathLike], file: str, offset: int,
                   what: Optional[str] = None) -> ManifestEntry:
    """The manifest's entry for the bytes at ``offset`` of ``file``; an error if it has none
    (readers that hash while reading look it up first, then call ``check_digest``)."""
    entry = manifest.lookup(file, offset)
    if entry is None and manifest.partial:  # not in this rank's part: the whole manifest decides
        whole = _manifest_on_disk(checkpoint_dir)
        entry = None if whole is None else whole.lookup(file, offset)
    if entry is None:
        raise CorruptCheckpointError(
            f"{Path(checkpoint_dir) / file}: bytes at offset {offset} ({what or file}) are not listed in "
            f"{MANIFEST_FNAME}; the checkpoint was modified after it was saved (load with "
            f"verify_checksums=False to skip the check)"
        )
    return entry


def check_digest(checkpoint_dir: Union[str, os.PathLike], file: str, offset: int, entry: ManifestEntry,
                 length: int, digest: str, what: Optional[str] = None) -> None:
    """``length`` bytes read at ``offset`` of ``file`` hashed to ``digest``: they must match ``entry``."""
    if entry.length != length or digest != entry.hash:
        label = what or (entry.key if entry.key else file)
        try:
            whole = _manifest_on_disk(checkpoint_dir) if os.path.isdir(checkpoint_dir) else None
        except CorruptCheckpointError:
            whole = None
        culprit = (f"the file or {MANIFEST_FNAME}, which is damaged itself (its own hash does not match)"
                   if whole is not None and whole.damaged else "the file")
        raise CorruptCheckpointError(
            f"{Path(checkpoint_dir) / file}: checksum mismatch for {label} at bytes [{offset}, "
            f"{offset + entry.length}) (read {length} bytes); {culprit} is damaged"
        )


def block_mismatch(path: Path, what: str, offset: int, length: int, entry: ManifestEntry) -> None:
    """A block read for part of an entry does not match its block hash. Either the data or the
    manifest's block hash is damaged: the whole entry, checked against its own hash, decides.
    Intact, the block read is good and the load goes on (a damaged manifest, logged); not, the
    file is damaged."""
    if entry_is_intact(path, entry):
        logger.warning("%s: %s's bytes match their %s entry, but the block hash recorded for bytes [%s, %s) does not: "
                       "%s is damaged, not the data (`dist-ckpt validate` reports it)",
                       path, what, MANIFEST_FNAME, offset, offset + length, MANIFEST_FNAME)
        return
    raise CorruptCheckpointError(
        f"{path}: checksum mismatch for {what} at bytes [{offset}, {offset + length}) (a block of its "
        f"{MANIFEST_FNAME} entry, and the whole entry's hash does not match either); the file is damaged"
    )


def entry_is_intact(path: Union[str, os.PathLike], entry: ManifestEntry) -> bool:
    """Whether the entry's bytes in ``path`` hash to its whole-entry hash (read in pieces): what
    decides between damaged data and a damaged block hash of the manifest."""
    hasher = new_hasher()
    try:
        with open(path, "rb") as f:
            f.seek(entry.offset)
            left = entry.length
            while left:
                piece = f.read(min(left, 16 << 20))
                if not piece:
                    return False
                hasher.update(piece)
                left -= len(piece)
    except OSError:
        return False
    return hasher.hexdigest() == entry.hash


def read_verified(checkpoint_dir: Union[str, os.PathLike], file: str, what: Optional[str] = None) -> bytes:
    """A whole small file's bytes, checked against the manifest."""
    data = (Path(checkpoint_dir) / file).read_bytes()
    verify_bytes(checkpoint_dir, file, 0, data, what)
    return data

"""Crash-consistent commits into a directory the training framework shares with us.

A save never writes into its target directory. The coordinator takes a lock beside the target
(``.<name>.dist_ckpt-lock``, an ``flock`` that dies with its process), creates a staging
directory beside it (``.<name>.dist_ckpt-staging-<save id>``) where every rank writes, and
commits once everything - data, common state, manifest and finally ``metadata.json`` - is
fsynced:

1. onto nothing or an empty directory: one ``rename``;
2. onto a directory that holds anything (files Megatron-LM or ModelOpt put there before or
   during the save, a previous checkpoint, what a crashed save left): every entry that is not
   part of the checkpoint being replaced is hard-linked into the staging directory (the same
   inode, so a writer holding it open keeps writing to the file that stays), then the two
   directories are swapped atomically (``renameat2(RENAME_EXCHANGE)``); entries that appeared
   in the old directory after the linking are moved over, and only then is the old directory,
   now holding nothing but the replaced checkpoint and links, deleted.

So a process killed at any instant leaves the old checkpoint or the new one at the target,
never a mix, and files dist_ckpt did not write stay at their paths throughout. What belongs
to a checkpoint (``checkpoint_entries``): ``metadata.json``, ``common.pt``, the DCP
``.metadata`` and ``*.distcp`` files, the manifest, the files the manifest lists, and zarr
array / ShardedObject directories; a name the new checkpoint itself writes replaces a foreign
entry of that name (as Megatron-Core's in-place save does), with a warning.

Where the filesystem cannot swap (NFS, Lustre, some FUSE), the old directory is renamed to
``.<name>.dist_ckpt-old-<save id>`` first, and deleted only after the new one is in place and
durable. If the process dies between the renames, or another process recreates the target
there (the second rename then fails), ``recover`` (run at once, by ``clean``, by the next save,
and named by the error of a load of the target) puts the old one back, moving into it what was
written at the target meanwhile; a moved-aside checkpoint is never deleted while no checkpoint
is at its target. Other leftover directories are ignored by loads and removed by the next
save of the same target or by ``dist-ckpt clean``, after any foreign file in them that is not at
the target is moved there.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import logging
import os
import shutil
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, List, Optional, Set, Union

from ..runtime.interrupts import interrupts_deferred
from ..core import CONFIG_FNAME, CheckpointExistsError, CheckpointingConfig, CheckpointingException, \
    CheckpointNotFoundError, config_bytes, \
    save_config

PathLike = Union[str, os.PathLike]

logger = logging.getLogger(__name__)

__all__ = [
    "fsync_path",
    "fsync_directory",
    "atomic_write_bytes",
    "commit_staged",
    "write_manifest_and_config",
    "ConcurrentSaveError",
    "SaveLock",
    "StagedSave",
    "begin_save",
    "staging_dir_for",
    "is_dist_ckpt_leftover",
    "checkpoint_entries",
    "checkpoint_entries_of",
    "link_checkpoint_entries",
    "leftovers_beside",
    "OVERWRITE_HINT",
    "clean",
    "recover",
]

# -- durability helpers: the only places that fsync and rename for atomicity ------------------


def fsync_path(path: PathLike) -> None:
    """Make a file's content, or a directory's entries (new or renamed files), durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


fsync_directory = fsync_path  # the name that says why at the call sites that fsync a directory


def atomic_write_bytes(path: PathLike, data: bytes) -> None:
    """Write ``data`` to ``path`` so that readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_directory(path.parent)



#: How to replace a committed checkpoint, in every form the refusal can come from.
OVERWRITE_HINT = "pass overwrite=True to save / convert_checkpoint, or --overwrite to dist-ckpt convert"
STAGING_MARK = ".dist_ckpt-staging-"
OLD_MARK = ".dist_ckpt-old-"
LOCK_MARK = ".dist_ckpt-lock"
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


class ConcurrentSaveError(CheckpointExistsError):
    """Another save is writing the same target right now."""


def staging_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{STAGING_MARK}{save_id}"


def _old_dir_for(target: Path, save_id: str) -> Path:
    return target.parent / f".{target.name}{OLD_MARK}{save_id}"


def _lock_path(target: Path) -> Path:
    return target.parent / f".{target.name}{LOCK_MARK}"


def is_dist_ckpt_leftover(path: Path) -> bool:
    """A staging or old directory (or a lock file) that dist_ckpt leaves behind."""
    name = path.name
    return name.startswith(".") and any(m in name for m in (STAGING_MARK, OLD_MARK, LOCK_MARK))


def leftovers_beside(target: Path) -> List[Path]:
    """The staging and moved-aside directories interrupted saves of ``target`` left beside it."""
    return _leftovers_of(target, STAGING_MARK) + _leftovers_of(target, OLD_MARK)


def _leftovers_of(target: Path, mark: str) -> List[Path]:
    prefix = f".{target.name}{mark}"
    if not target.parent.is_dir():
        return []
    return sorted(p for p in target.parent.iterdir() if p.name.startswith(prefix))


class SaveLock:
    """An exclusive ``flock`` on ``.<name>.dist_ckpt-lock``; released on ``release`` or death."""

    def __init__(self, target: Path) -> None:
        self.path = _lock_path(target)
        self._fd: Optional[int] = None
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    logger.warning("%s: this filesystem has no file locks; concurrent saves of %s will not be "
                                   "detected", self.path, target)
                    break
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    holder = self.path.read_text(errors="replace").strip() if self.path.exists() else "?"
                    raise ConcurrentSaveError(
                        f"Another save is writing {target} right now ({holder}); wait for it to finish "
                        f"or save elsewhere"
                    ) from None
                raise
            # The file may have been unlinked by the previous holder after we opened it.
            if os.path.exists(self.path) and os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                break
            os.close(fd)
        self._fd = fd
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()} on {os.uname().nodename}".encode())

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            self.path.unlink(missing_ok=True)
        finally:
            os.close(self._fd)
            self._fd = None

    def __del__(self) -> None:
        # A save abandoned without finalization (an AsyncRequest dropped on the floor) must
        # not keep its target locked for the life of the process.
        try:
            self.release()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing left to do
            pass


def _exchange(a: Path, b: Path) -> bool:
    """Atomically swap two directories; False if the filesystem/kernel cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, f"renameat2({a}, {b}, RENAME_EXCHANGE) failed: {os.strerror(err)}")


def _is_committed(path: Path) -> bool:
    return (path / CONFIG_FNAME).is_file()


def _foreign_checkpoint(path: Path) -> Optional[str]:
    """What another tool's checkpoint at ``path`` is (``formats.foreign_format_of``), or None."""
    from .formats import describe_foreign, foreign_format_in  # formats reads checkpoints; it sits above

    foreign = foreign_format_in(path)
    return None if foreign is None else describe_foreign(foreign)


# -- what belongs to a checkpoint, and what does not ---------------------------------------------

_CHECKPOINT_FILES = {CONFIG_FNAME, "common.pt", ".metadata", "dist_ckpt_manifest.json"}
_CHECKPOINT_FILE_RE = re.compile(r"^(.+\.distcp|\..+\.tmp-\d+)$")  # DCP data, our atomic-write temps
_ARRAY_OR_OBJECT_FILE_RE = re.compile(r"^(\.zarray|\.zattrs|\.zgroup|\d+(\.\d+)*|shard_[\d.]*_[\d.-]*\.pt)$")


def checkpoint_entries_of(files: Iterable[str], manifest_files: Iterable[str] = ()) -> Set[str]:
    """``checkpoint_entries`` of a listing: ``files`` are the relative paths (``/``-separated) of
    every file under a directory (or object-store prefix), ``manifest_files`` those its manifest
    lists. Top-level files with the format's own names, top-level directories holding only (and
    some) zarr array or ShardedObject files at any depth, and what the manifest lists."""
    names: Set[str] = set()
    foreign_dirs: Set[str] = set()
    dirs: Set[str] = set()
    for rel in files:
        top, _, rest = rel.partition("/")
        if not rest:
            if top in _CHECKPOINT_FILES or _CHECKPOINT_FILE_RE.match(top):
                names.add(top)
        elif _ARRAY_OR_OBJECT_FILE_RE.match(rest.rsplit("/", 1)[-1]):
            dirs.add(top)
        else:
            foreign_dirs.add(top)
    names.update(dirs - foreign_dirs)
    names.update(f.split("/", 1)[0] for f in manifest_files)
    return names


def checkpoint_entries(directory: Path) -> Set[str]:
    """Top-level names in ``directory`` that belong to the checkpoint stored there (committed,
    or left by a crashed save), as opposed to what other tools put beside it.

    The format's own names, the files the manifest lists, and directories that hold nothing but
    zarr array or ShardedObject files. Everything else is someone else's and is never deleted.
    """
    from ..integrity.manifest import MANIFEST_FNAME, parse_manifest

    files = []
    for root, _, names in os.walk(directory):  # does not follow symlinked directories
        prefix = os.path.relpath(root, directory)
        files += [name if prefix == "." else f"{prefix}/{name}".replace(os.sep, "/") for name in names]
    try:
        manifest_files: Iterable[str] = parse_manifest(
            (Path(directory) / MANIFEST_FNAME).read_bytes(), str(directory)).files
    except (OSError, ValueError):  # no manifest, or a damaged one (CorruptCheckpointError)
        manifest_files = ()
    return checkpoint_entries_of(files, manifest_files)


_LINK_UNSUPPORTED = (errno.EPERM, errno.EXDEV, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS)


def _link_or_copy(src: str, dst: Path) -> None:
    try:
        os.link(src, dst, follow_symlinks=False)
    except OSError as e:
        if e.errno not in _LINK_UNSUPPORTED:
            raise
        logger.warning("cannot hard-link %s (%s); copying it into the new checkpoint directory", src, e.strerror)
        shutil.copy2(src, dst, follow_symlinks=False)


def _link_foreign_entries(src: Path, dst: Path, skip: Set[str]) -> List[Path]:
    """Hard-link every entry of ``src`` but ``skip`` into ``dst`` (directories recreated);
    an entry whose name ``dst`` already has is replaced by it (logged). Returns the new dirs."""
    created: List[Path] = []
    for entry in os.scandir(src):
        if entry.name in skip:
            continue
        target = dst / entry.name
        if os.path.lexists(target):
            logger.warning("%s is replaced by the new checkpoint's entry of that name", entry.path)
            continue
        if entry.is_dir(follow_symlinks=False):
            target.mkdir()
            shutil.copystat(entry.path, target)
            created.append(target)
            created += _link_foreign_entries(Path(entry.path), target, set())
        else:
            _link_or_copy(entry.path, target)
    return created


def link_checkpoint_entries(src: Path, dst: Path) -> None:
    """Hard-link the checkpoint entries of ``src`` (``checkpoint_entries``) into ``dst``,
    directories recreated: a copy of the checkpoint that shares every byte with it. Safe to
    change by replacing files (``atomic_write_bytes``) or deleting them, never by writing in place."""
    ours = checkpoint_entries(src)
    others = {e for e in os.listdir(src) if e not in ours}
    for directory in _link_foreign_entries(src, dst, skip=others):
        fsync_directory(directory)
    fsync_directory(dst)


def _move_back_foreign_entries(old: Path, target: Path, keep_out: Set[str], old_wins: bool) -> None:
    """Entries of ``old`` (a replaced directory, or a leftover) that are not at ``target`` are
    moved there: files another tool wrote after they were linked. With ``old_wins`` (``old``
    is the directory that was at the target until the swap), a file of ``old`` that is not the
    inode at the target was replaced after linking and is the newer one: it replaces the link.
    Top-level names in ``keep_out`` (checkpoint entries) are never moved."""
    for entry in os.scandir(old):
        if entry.name in keep_out:
            continue
        dest = target / entry.name
        try:
            dest_stat = os.lstat(dest)
        except FileNotFoundError:
            os.rename(entry.path, dest)
            logger.warning("moved %s back to %s (written there while the checkpoint was committed)",
                           entry.name, target)
            continue
        src_stat = entry.stat(follow_symlinks=False)
        if entry.is_dir(follow_symlinks=False) and dest.is_dir() and not dest.is_symlink():
            _move_back_foreign_entries(Path(entry.path), dest, set(), old_wins)
        elif old_wins and (src_stat.st_ino, src_stat.st_dev) != (dest_stat.st_ino, dest_stat.st_dev):
            os.replace(entry.path, dest)


def _dispose_leftover(leftover: Path, target: Path) -> None:
    """Delete what an interrupted save left, after moving any file of another tool in it to the
    target (nothing that is not ours is ever deleted)."""
    with interrupts_deferred():  # half-moved foreign files must not be left to a cleanup
        _dispose(leftover, target)


def _dispose(leftover: Path, target: Path) -> None:
    ours = checkpoint_entries(leftover)
    foreign = [e for e in os.listdir(leftover) if e not in ours] if leftover.is_dir() else []
    if foreign:
        target.mkdir(exist_ok=True)
        _move_back_foreign_entries(leftover, target, ours | checkpoint_entries(target),
                                   old_wins=OLD_MARK in leftover.name)
    shutil.rmtree(leftover, ignore_errors=True)


def missing_target_hint(target: Path) -> str:
    """For the error of a load of a missing or uncommitted directory: the previous checkpoint an
    interrupted overwrite moved aside, if any."""
    olds = [p for p in _leftovers_of(Path(os.path.abspath(target)), OLD_MARK) if _is_committed(p)]
    if not olds:
        return ""
    return (f"; an interrupted overwrite left the previous checkpoint in {olds[-1]}: "
            f"`dist-ckpt clean {target}` puts it back")


def _restorable_olds(target: Path) -> List[Path]:
    """Committed checkpoints moved aside by an overwrite that did not finish, while no checkpoint
    is at the target: never disposed of, only put back (``recover``)."""
    if _is_committed(target):
        return []
    return [p for p in _leftovers_of(target, OLD_MARK) if _is_committed(p)]


def recover(target: Path) -> bool:
    """Put back a committed checkpoint that an interrupted overwrite moved aside; True if so.

    The target may have been recreated meanwhile (an overwrite without ``RENAME_EXCHANGE``,
    raced by another process): its files are moved into the old checkpoint first (the newer
    copy of a file wins), unless one has the name of a checkpoint file; then nothing is moved
    and the old checkpoint stays aside, kept (False)."""
    olds = _restorable_olds(target)
    if not olds or (os.path.lexists(target) and not target.is_dir()):
        return False
    old = olds[-1]
    if target.exists():
        if _foreign_checkpoint(target) is not None:
            return False
        ours = checkpoint_entries(old)
        clash = sorted(set(os.listdir(target)) & ours)
        if clash:
            logger.warning("cannot put %s back: %s holds %s now; it stays where it is", old, target, ", ".join(clash))
            return False
        _move_back_foreign_entries(target, old, set(), old_wins=True)
        fsync_directory(old)
        try:
            target.rmdir()
        except OSError:  # written to again meanwhile: try again later
            logger.warning("cannot put %s back: %s is being written to", old, target)
            return False
    os.rename(old, target)
    fsync_directory(target.parent)
    logger.warning("restored %s from %s (an overwrite of it was interrupted)", target, old.name)
    return True


def _disposable_leftovers(target: Path) -> List[Path]:
    """What interrupted saves left beside ``target`` that may go: staging directories, and
    moved-aside old directories unless one is the only copy of the checkpoint (``recover``
    could not put it back)."""
    keep = set(_restorable_olds(target))
    for old in keep:
        logger.warning("keeping %s: it holds the checkpoint of %s, which an interrupted overwrite moved aside "
                       "(`dist-ckpt clean %s` puts it back once nothing else writes there)", old, target, target)
    return [p for p in _leftovers_of(target, STAGING_MARK) + _leftovers_of(target, OLD_MARK) if p not in keep]


def clean(path: Path) -> List[Path]:
    """Remove what interrupted saves left beside ``path`` (a checkpoint, existing or not) and,
    if ``path`` is a directory, beside every checkpoint in it. Leftovers whose save is still
    running (its lock is held) are kept; files of other tools in them go to the target first.
    Returns what was removed; raises ``CheckpointNotFoundError`` for a path that is not there
    and has no leftovers (a typo should not look like a clean directory)."""
    path = Path(os.path.abspath(path))
    if not os.path.lexists(path) and not leftovers_beside(path):
        raise CheckpointNotFoundError(f"{path} does not exist, and no interrupted save of it left anything beside it: "
                                      f"nothing to clean (check the path)")
    if os.path.lexists(path) and not path.is_dir():
        raise CheckpointNotFoundError(f"{path} is not a directory; give a checkpoint directory or a directory of "
                                      f"checkpoints")
    targets = [path]
    if path.is_dir() and not _is_committed(path):
        names = {p.name.split(STAGING_MARK)[0].split(OLD_MARK)[0].split(LOCK_MARK)[0][1:]
                 for p in path.iterdir() if is_dist_ckpt_leftover(p)}
        targets += [path / n for n in sorted(names)]
    removed: List[Path] = []
    for target in targets:
        try:
            lock = SaveLock(target)
        except ConcurrentSaveError:
            logger.warning("a save of %s is running; its staging directory is kept", target)
            continue
        try:
            recover(target)
            for leftover in _disposable_leftovers(target):
                _dispose_leftover(leftover, target)
                removed.append(leftover)
        finally:
            lock.release()
    return removed


@dataclass
class StagedSave:
    """One save's staging directory, its target and the lock (held by the coordinator)."""

    target: Path
    staging: Path
    overwrite: Optional[bool]  # None: replace a committed checkpoint with a warning; False: refuse
    lock: Optional[SaveLock] = None

    @property
    def save_id(self) -> str:
        return self.staging.name.rsplit("-", 1)[-1]

    def commit(self) -> None:
        """Coordinator, after metadata.json is durable in the staging directory (module doc).
        A Ctrl-C during it takes effect once the commit is whole (``interrupts_deferred``)."""
        with interrupts_deferred():
            self._commit()

    def _commit(self) -> None:
        fsync_directory(self.staging)
        try:
            os.rename(self.staging, self.target)  # onto nothing or an empty directory: atomic
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise
            self._replace_non_empty_target()
        else:
            fsync_directory(self.target.parent)
        self.release()

    def _replace_non_empty_target(self) -> None:
        if self.overwrite is False and _is_committed(self.target):
            raise CheckpointExistsError(
                f"another save committed a checkpoint at {self.target} while this one ran; this save was "
                f"not committed and its files are removed ({OVERWRITE_HINT})"
            )
        foreign = _foreign_checkpoint(self.target)
        if foreign is not None and self.overwrite is not True:
            raise CheckpointExistsError(
                f"another tool wrote a {foreign} at {self.target} while this save ran; this save was not "
                f"committed and its files are removed (pass overwrite=True to replace it)"
            )
        parent = self.target.parent
        replaced = checkpoint_entries(self.target)
        new_entries = set(os.listdir(self.staging))
        for directory in [self.staging] + _link_foreign_entries(self.target, self.staging, replaced):
            fsync_directory(directory)
        old = _old_dir_for(self.target, self.save_id)
        if _exchange(self.staging, self.target):
            fsync_directory(parent)
            os.rename(self.staging, old)  # the staging name now holds the old directory: say so
        else:  # no atomic swap here (NFS, Lustre, some FUSE): move the old one aside first
            os.rename(self.target, old)
            fsync_directory(parent)
            try:
                os.rename(self.staging, self.target)
            except OSError as e:
                # Another process recreated the target between the two renames (Megatron-LM
                # writing a file into it, say). The old checkpoint goes back (recover), the
                # intruder's files into it; if that cannot be done now, it stays moved aside
                # and is never disposed of while the target holds no checkpoint: clean or the
                # next save puts it back.
                restored = recover(self.target)
                where = (f"the previous checkpoint is back at {self.target}" if restored else
                         f"the previous checkpoint is kept at {old} (`dist-ckpt clean {self.target}` puts it back)")
                raise CheckpointingException(
                    f"{self.target} was recreated by another process during this save's commit ({e.strerror}); "
                    f"this save was not committed and {where}. Make sure nothing else writes {self.target} "
                    f"while it is saved"
                ) from None
        fsync_directory(parent)  # the new checkpoint is in place and durable: only now does the old one go
        _move_back_foreign_entries(old, self.target, replaced | new_entries, old_wins=True)
        shutil.rmtree(old, ignore_errors=True)

    def abort(self) -> None:
        """Coordinator, after a failure every rank knows of: drop the staging directory."""
        shutil.rmtree(self.staging, ignore_errors=True)
        self.release()

    def release(self) -> None:
        if self.lock is not None:
            self.lock.release()
            self.lock = None


def begin_save(target: Path, overwrite: Optional[bool] = None) -> StagedSave:
    """Coordinator: lock, clean what earlier interrupted saves left, check the target,
    create the staging directory.

    ``overwrite``: None (Megatron-Core's behaviour) replaces a committed checkpoint at the
    target with a warning, True replaces it silently, False refuses. A target that holds other
    committed checkpoints (a parent directory given by mistake) is always refused.
    """
    from .locations import checkpoints_inside  # the rule over directory trees; it uses this module

    target = Path(os.path.abspath(target))
    if target.exists() and not target.is_dir():
        raise CheckpointExistsError(f"{target} exists and is not a directory; a checkpoint is a directory")
    inside = checkpoints_inside(target) if target.is_dir() else []
    if inside:
        names = ", ".join(inside[:5]) + (", ..." if len(inside) > 5 else "")
        raise CheckpointExistsError(
            f"{target} holds other checkpoints ({names}); nothing was written. A checkpoint directory cannot "
            f"contain checkpoints - save to a new directory such as {target / 'iter_0000001'}"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    lock = SaveLock(target)
    try:
        recover(target)
        for leftover in _disposable_leftovers(target):
            logger.warning("removing %s, left by an interrupted save", leftover)
            _dispose_leftover(leftover, target)
        if _is_committed(target):
            if overwrite is False:
                raise CheckpointExistsError(
                    f"{target} already holds a committed checkpoint ({CONFIG_FNAME} exists); save to a new "
                    f"directory, or replace it once the new one is complete: {OVERWRITE_HINT}"
                )
            if overwrite is None:
                logger.warning("%s holds a committed checkpoint; it will be replaced when this save commits "
                               "(other files in the directory are kept)", target)
        elif (foreign := _foreign_checkpoint(target)) is not None:
            if overwrite is not True:
                raise CheckpointExistsError(
                    f"{target} holds a {foreign} written by another tool (not a dist_ckpt save); nothing was "
                    f"written. Save to another directory, or pass overwrite=True to replace it (its files of "
                    f"other formats are kept)"
                )
            logger.warning("%s holds a %s; it is replaced when this save commits (overwrite=True)", target, foreign)
        elif target.is_dir() and any(checkpoint_entries(target)):
            logger.warning("%s holds files of an incomplete checkpoint; they will be replaced when this save "
                           "commits (other files in the directory are kept)", target)
        staging = staging_dir_for(target, uuid.uuid4().hex[:12])
        staging.mkdir()
        fsync_directory(target.parent)
    except BaseException:
        lock.release()
        raise
    return StagedSave(target, staging, overwrite, lock)


def write_manifest_and_config(directory: Path, config: CheckpointingConfig, entries: "List[Any]") -> None:
    """The manifest, then ``metadata.json`` (both hashed, in the manifest): a checkpoint's last files."""
    from ..integrity.manifest import ManifestEntry, hash_bytes, write_manifest

    content = config_bytes(config)
    write_manifest(directory, list(entries) + [ManifestEntry(CONFIG_FNAME, 0, len(content), hash_bytes(content))])
    save_config(config, directory)


def commit_staged(staged: StagedSave, config: CheckpointingConfig, entries: "List[Any]") -> None:
    """Coordinator: the manifest and ``metadata.json``, then the atomic commit of the staging
    directory onto the target."""
    write_manifest_and_config(staged.staging, config, entries)
    staged.commit()

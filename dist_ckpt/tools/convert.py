"""Rewrite a checkpoint in another backend, one tensor in memory at a time.

Call order (one process, no process group needed): read the source's metadata, common state
and objects; write common state; stream every tensor (load it whole from the source, hand it
to the target strategy's ``save_stream``, drop it) and the objects; commit ``metadata.json``
last. The result loads bit-exact; the source is not modified.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional, Union

from ..core import CheckpointingConfig, CheckpointingException
from ..integrity.manifest import forget_recorder, open_recorder
from ..mapping import ShardedObject, ShardedStateDict, ShardedTensor
from ..runtime.timing import phase
from ..serialization import load_sharded_metadata, verify_checkpoint_and_load_strategy
from ..storage.commit import begin_save, commit_staged
from ..storage.object_store import begin_remote_save, is_url, localize, new_scratch_dir, publish_checkpoint
from ..strategies.base import StrategyAction, resolve_strategy

logger = logging.getLogger(__name__)

__all__ = ["convert_checkpoint"]


def convert_checkpoint(src: Union[str, os.PathLike], dst: Union[str, os.PathLike], backend: str, version: int = 1,
                       *, overwrite: bool = False, storage_options: Optional[dict] = None,
                       progress: Optional[Callable[[Iterable], Iterable]] = None) -> None:
    """Write the checkpoint ``src`` as a new checkpoint ``dst`` of ``(backend, version)``.

    ``src`` and ``dst`` may be URLs (``storage_options`` for fsspec): a URL source is read from
    the local cache, a URL target is written locally, then uploaded and committed as a save to
    a URL is. ``progress`` wraps the iteration over tensors (e.g. ``tqdm``).

    ``dst`` must not hold a committed checkpoint unless ``overwrite`` (then it is replaced once
    the new one is complete; ``src == dst`` converts in place); files of other tools in ``dst``
    are kept, and a ``dst`` that holds other checkpoints (a parent directory) is refused.
    """
    if is_url(dst):
        remote = begin_remote_save(str(dst), overwrite, storage_options)
        scratch = new_scratch_dir("convert")
        try:
            convert_checkpoint(src, scratch / "checkpoint", backend, version, storage_options=storage_options,
                               progress=progress)
            with phase("convert: upload and commit"):
                publish_checkpoint(scratch / "checkpoint", remote)
        except BaseException:
            remote.abort()
            raise
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return
    src, dst = localize(src, storage_options), Path(dst)
    loader, common_loader = verify_checkpoint_and_load_strategy(src)
    saver = resolve_strategy(StrategyAction.SAVE_SHARDED, (backend, version), None)
    common_saver = resolve_strategy(StrategyAction.SAVE_COMMON, ("torch", 1), None)
    with phase("convert: metadata"):
        metadata = load_sharded_metadata(src, loader, common_loader)
        plain = loader.plain_object_keys(src)
    if plain:  # never a converted checkpoint silently short of them
        raise CheckpointingException(
            f"{src}: {', '.join(map(repr, plain))} are plain DCP objects (values of a dcp.save state dict), which "
            f"convert does not carry: it converts ShardedTensors and ShardedObjects. Load them with "
            f"torch.distributed.checkpoint.load (dist_ckpt.strategies.filesystem.FileSystemReader)")
    tensors = [v for v in metadata.values() if isinstance(v, ShardedTensor)]
    objects = [v for v in metadata.values() if isinstance(v, ShardedObject)]
    staged = begin_save(dst, overwrite=overwrite)
    open_recorder(staged.staging)
    try:
        with phase("convert: tensors"):
            _convert_into(staged.staging, loader, common_loader, saver, common_saver, src, tensors, objects, progress)
        config = CheckpointingConfig(saver.backend, saver.version, common_saver.backend, common_saver.version)
        with phase("convert: commit"):
            commit_staged(staged, config, forget_recorder(staged.staging))
    except BaseException:
        forget_recorder(staged.staging)
        staged.abort()
        raise


def _convert_into(dst, loader, common_loader, saver, common_saver, src, tensors, objects, progress=None) -> None:
    if objects:
        request = {o.unique_key: o for o in objects}
        loaded = (loader.load(request, src) if loader.can_handle_sharded_objects
                  else common_loader.load_sharded_objects(request, src))
        for o in objects:
            o.data = loaded[o.unique_key]
    common_saver.save_common(common_loader.load_common(src), dst)

    def batches() -> Iterator[ShardedStateDict]:
        for sh in (progress(tensors) if progress else tensors):
            sh.init_data("cpu")
            loader.load({sh.key: sh}, src)
            logger.info("converting %s %s %s", sh.key, tuple(sh.global_shape), sh.dtype)
            yield {sh.key: sh}
            sh.data = None  # the only reference: freed before the next tensor is read
        if objects and saver.can_handle_sharded_objects:
            yield {o.unique_key: o for o in objects}

    saver.save_stream(batches(), dst)
    if objects and not saver.can_handle_sharded_objects:
        common_saver.save_sharded_objects({o.unique_key: o for o in objects}, dst)

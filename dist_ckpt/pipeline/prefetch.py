"""The load coordinator reads the checkpoint's index while it waits for the other ranks.

Why: with the access check, the coordinator first waits in a gather while every rank
describes its request; with ranks that share cores it then reads ``.metadata`` and the manifest
and cuts every rank's part while all the others wait (``pipeline.load._cut_parts``). Both
readings are the coordinator's alone and need nothing from the other ranks, so a thread reads
them during the first wait, when the coordinator's main thread sleeps in the collective: on 8
ranks of 1,000 keys on 2 cores, they were a third of the ~130 ms the other ranks waited for.

The thread only fills the per-process caches that the later readings go through
(``LoadShardedStrategy.prefetch_index``, ``integrity.manifest.load_manifest``; both keyed by the
file's stamp, so a file replaced meanwhile is read again), in a copy of the caller's context
(the checksum setting is part of those keys). Whatever fails in it is ignored: the same reading
on the main thread reports it in its own words. ``wait`` joins it, so it never outlives the step
that started it and never reads at the same time as the main thread.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from pathlib import Path
from typing import Any, Optional

from ..integrity.manifest import load_manifest, verification_enabled
from ..validation import verify_checkpoint_and_load_strategy

__all__ = ["IndexPrefetch"]

logger = logging.getLogger(__name__)


class IndexPrefetch:
    """One load's background reading of ``directory``'s index and manifest (``start`` once,
    ``wait`` before reading them on the main thread; both may be called when nothing started)."""

    def __init__(self, directory: Path, sharded_strategy: Any, common_strategy: Any) -> None:
        self.directory = directory
        self._strategies = (sharded_strategy, common_strategy)
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        if self._thread is not None:
            return
        context = contextvars.copy_context()
        thread = threading.Thread(target=context.run, args=(self._read,), daemon=True,
                                  name="dist_ckpt-index-prefetch")
        try:
            thread.start()
        except RuntimeError as exc:  # no thread to be had: the main thread reads, as without this
            logger.debug("not prefetching the index of %s: %s", self.directory, exc)
            return
        self._thread = thread

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()

    def _read(self) -> None:
        try:
            sharded, _ = verify_checkpoint_and_load_strategy(self.directory, *self._strategies)
            sharded.prefetch_index(self.directory)
            if verification_enabled():
                load_manifest(self.directory)
        except BaseException as exc:  # noqa: BLE001 - the main thread's reading reports it
            logger.debug("prefetching the index of %s failed (read again later): %r", self.directory, exc)

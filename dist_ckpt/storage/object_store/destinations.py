"""Where the files of a save being written finally live, for writers that put them there
themselves.

A save to a URL writes into a local scratch directory that the pipeline uploads at commit
(``upload``). A DCP storage writer a user gave the ``torch_dist`` strategy (torch's
``FsspecWriter``, an S3 connector's writer) writes its files straight into the store instead:
it must be given the save directory's URL, not the scratch path, and the pipeline must not try
to upload what it wrote. This registry, keyed by the directory a strategy is handed (as the
manifest recorders are), carries both facts between the pipeline and the strategy.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Dict, Iterable, Set, Tuple, Union

__all__ = ["register_destination", "destination_of", "note_written_at_destination", "forget_destination"]

_destinations: Dict[str, Tuple[str, Set[str]]] = {}
_lock = threading.Lock()


def register_destination(directory: Union[str, os.PathLike], url: str) -> None:
    """The save writing ``directory`` (a scratch directory) ends up at ``url``."""
    with _lock:
        _destinations[os.path.abspath(directory)] = (url, set())


def destination_of(directory: Union[str, os.PathLike]) -> str:
    """The URL the save writing ``directory`` ends up at, or the directory itself (local saves)."""
    with _lock:
        entry = _destinations.get(os.path.abspath(directory))
    return entry[0] if entry is not None else str(Path(directory))


def note_written_at_destination(directory: Union[str, os.PathLike], names: Iterable[str]) -> None:
    """Files (relative names) a writer put at the destination itself: nothing to upload."""
    with _lock:
        entry = _destinations.get(os.path.abspath(directory))
        if entry is not None:
            entry[1].update(names)


def forget_destination(directory: Union[str, os.PathLike]) -> Set[str]:
    """End of the save: the names written at the destination (empty for a local save)."""
    with _lock:
        entry = _destinations.pop(os.path.abspath(directory), None)
    return set(entry[1]) if entry is not None else set()

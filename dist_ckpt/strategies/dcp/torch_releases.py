"""The DCP index (``.metadata``) across torch releases: every release's form read, and the
form every supported release reads written.

A checkpoint outlives the torch that wrote it. The one difference in ``.metadata`` between
torch 2.11 and 2.15 is ``TensorProperties``: torch 2.15 added a sixth field, ``strides`` (the
writing rank's local strides, taken from the tensor by ``create_from_tensor``; torch's own
writer records them for every tensor, a contiguous one included), and its ``__getstate__``
always pickles six fields. torch 2.11-2.14 unpack exactly five in ``__setstate__``, so an index
written under 2.15 fails there with "too many values to unpack (expected 5)".

No loader of any of these releases reads ``strides``: a DCP item's stored bytes carry their own
layout, and a load copies them into the destination's (checked in torch 2.15: only the save side
of ``torch.distributed._shard`` ShardedTensors passes them on). So:

* **reading** (``TensorPropertiesOfAnyRelease``, what the allowlisted unpickler resolves
  ``TensorProperties`` to): five or six fields under any release; under a torch without the
  field, the sixth is dropped; under a torch with it, it is kept. A form with more fields is a
  newer format, not damage: ``UnsupportedFormatError``.
* **writing** (``portable_metadata_bytes`` for dist_ckpt's own writers, ``portable_metadata``
  for a user's DCP storage writer, which pickles the index itself): ``TensorProperties`` as the
  five fields every release reads, ``strides`` dropped, which no reader loses.

One difference of behaviour, too: torch 2.11's ``dcp.load`` swallows the exception a storage
reader's ``read_metadata`` raises and reports "metadata is None" (2.12 and newer name it);
``DCP_LOAD_HIDES_READER_ERRORS`` says so, and dist_ckpt's reader then logs its error first.

Private torch names this relies on, each checked by ``tests/test_torch_releases.py``: the
``TensorProperties`` fields and its ``__getstate__`` / ``__setstate__`` tuple, and the message
of ``state_dict_loader`` that names a reader's error.
"""

from __future__ import annotations

import copy
import copyreg
import dataclasses
import io
import pickle
from typing import Any, Callable, Dict, Tuple

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)

from ...core import UnsupportedFormatError

__all__ = [
    "TORCH_HAS_STRIDES",
    "DCP_LOAD_HIDES_READER_ERRORS",
    "PORTABLE_PROPERTY_FIELDS",
    "TensorPropertiesOfAnyRelease",
    "portable_metadata_bytes",
    "portable_metadata",
    "property_fields",
]

#: whether the running torch's ``TensorProperties`` has ``strides`` (2.15 and newer)
TORCH_HAS_STRIDES = "strides" in {f.name for f in dataclasses.fields(TensorProperties)}
#: the fields of the form every supported release unpickles (dtype, layout, requires_grad,
#: memory format, pin_memory)
PORTABLE_PROPERTY_FIELDS = 5
_FIELDS_READ = (5, 6)  # 6: torch 2.15's strides last
#: whether the running torch's ``dcp.load`` replaces a reader's ``read_metadata`` error with
#: "metadata is None" (2.11; 2.12 added "global metadata read failed: <the error>")
DCP_LOAD_HIDES_READER_ERRORS = tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < (2, 12)


def property_fields(properties: TensorProperties) -> Tuple[Any, ...]:
    """Every field of ``properties`` that tells two of them apart, ``strides`` included where the
    running torch (or a newer one's index) has them: properties that differ only in strides are
    not the same."""
    return (properties.dtype, properties.layout, properties.requires_grad, properties.memory_format,
            properties.pin_memory, getattr(properties, "strides", None))


class TensorPropertiesOfAnyRelease(TensorProperties):
    """What ``.metadata``'s ``TensorProperties`` is unpickled as: torch's class, rebuilt from any
    supported release's state. Each instance becomes a plain ``TensorProperties`` in
    ``__setstate__`` (its class is switched back), so nothing downstream sees this subclass."""

    def __setstate__(self, state: Any) -> None:
        self.__class__ = TensorProperties  # type: ignore[assignment]
        if type(state) is tuple and len(state) == 5:  # every release's form: the common case first
            _setstate(self, state)
            return
        if not isinstance(state, tuple) or len(state) not in _FIELDS_READ:
            found = f"a state of {len(state)} fields" if isinstance(state, tuple) else f"a {type(state).__name__}"
            raise UnsupportedFormatError(
                f"its TensorProperties hold {found}; torch 2.11-2.15 pickle 5 or 6 (a newer torch's form)")
        if len(state) == 6:
            strides = state[5]
            if strides is not None and not (isinstance(strides, tuple) and all(type(s) is int for s in strides)):
                raise UnsupportedFormatError(
                    f"its TensorProperties hold strides {str(strides)[:60]}, not a tuple of ints (a newer torch's form)")
            if not TORCH_HAS_STRIDES:
                state = state[:5]  # this torch has no such field, and no loader reads it
        _setstate(self, state)


_setstate = TensorProperties.__setstate__


def _five_fields(properties: TensorProperties) -> Tuple[Callable[..., Any], Tuple[Any, ...], Tuple[Any, ...]]:
    """``properties`` reduced to torch's own pickled form with its first five fields: the bytes
    torch 2.11-2.14 write for it."""
    state = properties.__getstate__()[:PORTABLE_PROPERTY_FIELDS]
    return copyreg.__newobj__, (TensorProperties,), state  # type: ignore[attr-defined]


def _plain_state(obj: Any) -> Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]]:
    """What ``object.__reduce_ex__`` gives a plain dataclass (its class, its ``__dict__``), without
    the generic path's lookups: a large index pickles 10^5 to 10^6 such objects."""
    return copyreg.__newobj__, (type(obj),), obj.__dict__  # type: ignore[attr-defined]


def _storage_info_state(info: _StorageInfo) -> Tuple[Callable[..., Any], Tuple[Any, ...], Dict[str, Any]]:
    """``_StorageInfo`` as its own ``__getstate__`` pickles it: the fields that are not None."""
    state = {"relative_path": info.relative_path, "offset": info.offset, "length": info.length}
    if info.transform_descriptors is not None:
        state["transform_descriptors"] = info.transform_descriptors
    return copyreg.__newobj__, (_StorageInfo,), state  # type: ignore[attr-defined]


_PORTABLE = {**copyreg.dispatch_table, TensorProperties: _five_fields}
_FAST = {ChunkStorageMetadata: _plain_state, MetadataIndex: _plain_state, TensorStorageMetadata: _plain_state,
         _StorageInfo: _storage_info_state}


def _fast_reductions_agree() -> bool:
    """Whether ``_FAST`` pickles a sample index to the very bytes of pickle's own reductions under
    the running torch (a release that pickles one of these classes its own way keeps the slow
    path: the bytes written never depend on this shortcut)."""
    size = torch.Size([2, 3])
    sample = {"chunks": TensorStorageMetadata(TensorProperties(dtype=torch.float32), size,
                                              [ChunkStorageMetadata(torch.Size([0, 0]), size)]),
              "storage": {MetadataIndex("w", torch.Size([0, 0]), 3): _StorageInfo("__0_0.distcp", 64, 1000),
                          MetadataIndex("b"): _StorageInfo("__0_0.distcp", 0, 8, ["zstd"])}}

    def dumps(table: Dict[Any, Any]) -> bytes:
        buffer = io.BytesIO()
        pickler = pickle.Pickler(buffer, protocol=pickle.DEFAULT_PROTOCOL)
        pickler.dispatch_table = table
        pickler.dump(sample)
        return buffer.getvalue()

    try:
        return dumps({**_PORTABLE, **_FAST}) == dumps(_PORTABLE)
    except Exception:  # noqa: BLE001 - a class that cannot take the shortcut keeps the slow path
        return False


class _PortablePickler(pickle.Pickler):
    dispatch_table: Any = {**_PORTABLE, **_FAST} if _fast_reductions_agree() else _PORTABLE


def portable_metadata_bytes(metadata: Metadata) -> bytes:
    """``pickle.dumps(metadata)`` as torch 2.11-2.14 would write it, under any torch: every
    release's ``dcp.load`` (and Megatron-Core's) reads it. The index's dataclasses are reduced
    by ``_FAST`` (the same bytes; 1.5x faster for an index of 200,000 chunks)."""
    buffer = io.BytesIO()
    _PortablePickler(buffer, protocol=pickle.DEFAULT_PROTOCOL).dump(metadata)
    return buffer.getvalue()


class _PortableTensorProperties(TensorProperties):
    """A ``TensorProperties`` that pickles as torch's class in the five-field form, whoever
    pickles it (a user's storage writer calls plain ``pickle.dump``). Its ``__class__`` answers
    torch's class: the pickler checks an object's ``__class__`` against the class its reduction
    names (``copyreg.__newobj__``), the form torch itself pickles to."""

    @property  # type: ignore[misc]
    def __class__(self) -> type:
        return TensorProperties

    def __reduce_ex__(self, protocol: Any) -> Any:
        return _five_fields(self)


def portable_metadata(metadata: Metadata) -> Metadata:
    """A copy of ``metadata`` whose tensor properties pickle in the five-field form, for a storage
    writer that pickles the index itself; ``metadata`` is not changed. The copy is shallow but for
    each tensor's entry (its chunks are shared)."""
    if not TORCH_HAS_STRIDES:
        return metadata  # this torch pickles five fields itself
    portable: Dict[Any, TensorProperties] = {}

    def converted(properties: TensorProperties) -> TensorProperties:
        key = id(properties)
        if key not in portable:
            copied = object.__new__(_PortableTensorProperties)
            copied.__dict__.update(properties.__dict__)
            portable[key] = copied
        return portable[key]

    entries = {}
    for fqn, md in metadata.state_dict_metadata.items():
        if isinstance(md, TensorStorageMetadata) and type(md.properties) is TensorProperties:
            md = copy.copy(md)
            md.properties = converted(md.properties)
        entries[fqn] = md
    copied = copy.copy(metadata)  # not dataclasses.replace: Megatron-Core's subclass adds attributes
    copied.state_dict_metadata = entries
    return copied

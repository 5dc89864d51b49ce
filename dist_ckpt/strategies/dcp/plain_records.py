"""DCP's plan and index records (``WriteItem``, ``ReadItem``, ``MetadataIndex``...) made without
their dataclass ``__init__``.

A frozen dataclass sets each field through ``object.__setattr__``: a rank of 100,000 small
tensors makes four or five such records per tensor and item in a save and as many in a load
(3.0 us for a write item's four records, 1.6 us made here). ``made`` fills the instance's
``__dict__`` as the generated ``__init__`` does for these classes (none has ``__slots__``, a
``__post_init__`` or a conversion); ``made_as_given`` is for ``MetadataIndex``, whose own
``__init__`` converts the offset (callers pass a ``torch.Size``: ``SharedSizes.index``). Each is
checked against the real constructor, field for field and pickled byte for byte
(``tests/test_per_item_paths.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Tuple, Type, TypeVar

__all__ = ["made", "made_as_given"]

T = TypeVar("T")

_new = object.__new__
_fields: Dict[type, Tuple[Tuple[str, Any, Any], ...]] = {}


def _fields_of(cls: type) -> Tuple[Tuple[str, Any, Any], ...]:
    """(name, default, default factory) of each field of ``cls``, in the order its ``__init__``
    sets them (a release may add a field with a default: ``WriteItem.bytes_io_data``)."""
    found = _fields.get(cls)
    if found is None:
        found = _fields[cls] = tuple((f.name, f.default, f.default_factory) for f in dataclasses.fields(cls))
    return found


def made(cls: Type[T], **fields: Any) -> T:
    """An instance of the dataclass ``cls`` as its generated ``__init__`` leaves it: every field
    in field order, those not given at their default."""
    obj = _new(cls)
    state = obj.__dict__
    for name, default, factory in _fields_of(cls):
        if name in fields:
            state[name] = fields[name]
        elif default is not dataclasses.MISSING:
            state[name] = default
        else:
            state[name] = factory()
    return obj


def made_as_given(cls: Type[T], **fields: Any) -> T:
    """An instance of ``cls`` holding exactly ``fields``, in their order: for a class whose own
    ``__init__`` sets these (``MetadataIndex``: fqn, index, then the offset if there is one)."""
    obj = _new(cls)
    obj.__dict__.update(fields)
    return obj

"""DCP's frozen plan and index records (``WriteItem``, ``TensorWriteData``, ``WriteResult``,
``ReadItem``, ``MetadataIndex``) and the planner's ``StoredChunk``, made without their dataclass
``__init__``.

A frozen dataclass sets each field through ``object.__setattr__``: a rank of 100,000 small
tensors makes several such records per tensor in a save and as many in a load (3.0 us for a
write item's four records, 1.6 us made here; the records that are not frozen are made faster by
their own ``__init__``). ``made`` fills the instance's ``__dict__`` as the generated ``__init__``
does for these classes (none has ``__slots__``, a ``__post_init__`` or a conversion);
``made_as_given`` is for ``MetadataIndex``, whose own ``__init__`` converts the offset (callers
pass a ``torch.Size``: ``SharedSizes.index``). Each is checked against the real constructor,
field for field and pickled byte for byte (``tests/test_per_item_paths.py``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Type, TypeVar

__all__ = ["made", "made_as_given"]

T = TypeVar("T")

_new = object.__new__
_templates: Dict[type, Dict[str, Any]] = {}


def _template_of(cls: type) -> Dict[str, Any]:
    """Every field of ``cls`` in the order its ``__init__`` sets them, at its default (a release
    may add a field with a default: ``WriteItem.bytes_io_data``); a field without one holds
    ``dataclasses.MISSING`` until the caller's value replaces it. Classes whose fields have
    default factories are not made here."""
    template = _templates.get(cls)
    if template is None:
        template = {}
        for f in dataclasses.fields(cls):
            if f.default_factory is not dataclasses.MISSING:
                raise TypeError(f"{cls.__name__}.{f.name} has a default factory: construct it")
            template[f.name] = f.default
        _templates[cls] = template
    return template


def made(cls: Type[T], **fields: Any) -> T:
    """An instance of the dataclass ``cls`` as its generated ``__init__`` leaves it: every field
    in field order, those not given at their default (the caller gives every field without one)."""
    obj = _new(cls)
    state = obj.__dict__
    state.update(_templates.get(cls) or _template_of(cls))
    state.update(fields)  # replacing a key keeps its place
    return obj


def made_as_given(cls: Type[T], **fields: Any) -> T:
    """An instance of ``cls`` holding exactly ``fields``, in their order: for a class whose own
    ``__init__`` sets these (``MetadataIndex``: fqn, index, then the offset if there is one)."""
    obj = _new(cls)
    obj.__dict__.update(fields)
    return obj

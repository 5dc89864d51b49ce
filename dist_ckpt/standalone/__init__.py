"""Modules that import nothing but the standard library, ``xxhash`` and ``runtime.durable``
(a leaf of the standard library alone).

The checkpoint writer process runs them without importing torch or the rest of dist_ckpt
(``writer_main``): a process that imports torch holds about 200 MiB of its own (Python's
objects of torch's modules, torch's relocated libraries), which a writer spawned during
training adds to every rank's host memory. The training process uses the same modules (the
hashing of items, the layout of a tensor's record, the arena table), so that what the writer
writes is what the thread writer writes, byte for byte.

Nothing here may import torch or any other module of ``dist_ckpt``: ``tests/test_writer_memory.py``
imports every module here as the writer process does and checks that torch stays out.
"""

__all__: list = []

"""The conformance suite on every backend: torch_dist and zarr writers; torch_dist, zarr-python
and tensorstore readers."""

from __future__ import annotations

import os
from pathlib import Path

from conformance import BackendConformance


class TestTorchDist(BackendConformance):
    save_strategy = ("torch_dist", 1)

    def corrupt(self, ckpt: Path, key: str) -> None:
        for name in os.listdir(ckpt):
            if name.endswith(".distcp"):
                os.remove(ckpt / name)


class _Zarr(BackendConformance):
    save_strategy = ("zarr", 1)
    saves_flattened = False

    def corrupt(self, ckpt: Path, key: str) -> None:
        chunks = [p for p in (ckpt / key).iterdir() if not p.name.startswith(".")]
        chunks[0].unlink()


class TestZarrWithTensorStore(_Zarr):
    load_strategy = None  # the default reader of zarr checkpoints: tensorstore


class TestZarrWithZarrPython(_Zarr):
    load_strategy = "dist_ckpt.strategies.zarr:ZarrLoadShardedStrategy"

"""The strategy registry: duplicates, overrides, lazy built-ins, entry points, missing libraries."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import dist_ckpt
from conftest import FIXTURES
from dist_ckpt import DuplicateStrategyError, StrategyAction, StrategyRegistry, UnknownStrategyError
from dist_ckpt.strategies.common import TorchCommonLoadStrategy
from dist_ckpt.strategies.torch_dist import TorchDistLoadShardedStrategy, TorchDistSaveShardedStrategy


def test_register_refuses_duplicates_unless_override():
    registry = StrategyRegistry()
    first, second = TorchDistSaveShardedStrategy(), TorchDistSaveShardedStrategy(thread_count=2)
    registry.register(StrategyAction.SAVE_SHARDED, "mine", 1, first)
    with pytest.raises(DuplicateStrategyError, match="already registered for save_sharded mine v1.*override=True"):
        registry.register("save_sharded", "mine", 1, second)
    assert registry.get(StrategyAction.SAVE_SHARDED, "mine", 1) is first
    registry.register("save_sharded", "mine", 1, second, override=True)
    assert registry.get("save_sharded", "mine", 1) is second
    with pytest.raises(UnknownStrategyError, match="Only strategy objects"):
        registry.register("save_sharded", "x", 1, object())


def test_builtins_are_lazy_and_never_replace_a_user_entry():
    registry = StrategyRegistry()
    mine = TorchDistLoadShardedStrategy()
    registry.register(StrategyAction.LOAD_SHARDED, "torch_dist", 1, mine)
    assert registry.get(StrategyAction.LOAD_SHARDED, "torch_dist", 1) is mine
    builtin = registry.get(StrategyAction.LOAD_COMMON, "torch", 1)
    assert isinstance(builtin, TorchCommonLoadStrategy)
    assert registry.get(StrategyAction.LOAD_COMMON, "torch", 1) is builtin  # instantiated once
    rows = {(r.action, r.backend, r.version): r for r in registry.available()}
    assert rows[(StrategyAction.LOAD_SHARDED, "torch_dist", 1)].source == "user"
    assert rows[(StrategyAction.LOAD_SHARDED, "zarr", 1)].source == "builtin"
    assert all(r.importable for r in rows.values())


def test_unknown_key_lists_what_is_registered():
    with pytest.raises(UnknownStrategyError, match=r"load_sharded backend 'nope' version 3\. Registered: \[.*'load_sharded zarr v1'.*\]"):
        StrategyRegistry().get(StrategyAction.LOAD_SHARDED, "nope", 3)
    with pytest.raises(UnknownStrategyError, match="Unknown strategy action 'explode'"):
        StrategyRegistry().get("explode", "torch", 1)
    assert isinstance(UnknownStrategyError("x"), KeyError) and str(UnknownStrategyError("x")) == "x"


def test_register_default_strategy_replaces_the_default_as_in_megatron(tmp_path):
    from dist_ckpt.strategies.base import default_registry

    before = dist_ckpt.get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1)
    tuned = TorchDistSaveShardedStrategy(thread_count=2)
    try:
        dist_ckpt.register_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1, tuned)
        assert dist_ckpt.get_default_strategy(StrategyAction.SAVE_SHARDED, "torch_dist", 1) is tuned
        dist_ckpt.save({k: dist_ckpt.ShardedTensor.from_rank_offsets(k, torch.arange(4.0)) for k in "ab"}, tmp_path / "c")
        assert sorted(p.name for p in (tmp_path / "c").glob("*.distcp")) == ["__0_0.distcp", "__0_1.distcp"]
    finally:
        default_registry.register(StrategyAction.SAVE_SHARDED, "torch_dist", 1, before, override=True)


def _run(code: str, *path: str) -> subprocess.CompletedProcess:
    env_path = ":".join(path)
    prelude = f"import sys; sys.path[:0] = {list(path)!r}\n" if env_path else ""
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], capture_output=True, text=True, timeout=120)


def test_entry_point_strategies_are_found(tmp_path):
    """A real distribution (dist-info with entry_points.txt) on sys.path, found by importlib.metadata."""
    (tmp_path / "my_ckpt_plugin.py").write_text(textwrap.dedent('''
        from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

        class OneFileSave(TorchDistSaveShardedStrategy):
            pass

        def register(registry):
            registry.register("save_sharded", "plugin_backend", 2, OneFileSave("plugin_backend", 2))
            registry.register("load_common", "torch", 1, OneFileSave())  # clashes: must not replace
    '''))
    dist_info = tmp_path / "my_ckpt_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text("Metadata-Version: 2.1\nName: my-ckpt-plugin\nVersion: 1.0\n")
    (dist_info / "entry_points.txt").write_text("[dist_ckpt.strategies]\nmine = my_ckpt_plugin:register\n")
    out = _run('''
        import dist_ckpt
        from dist_ckpt import StrategyAction, StrategyRegistry
        registry = StrategyRegistry()
        user = registry.get(StrategyAction.LOAD_COMMON, "torch", 1)
        strategy = registry.get(StrategyAction.SAVE_SHARDED, "plugin_backend", 2)
        print(type(strategy).__name__, strategy.backend, strategy.version)
        print(type(registry.get(StrategyAction.LOAD_COMMON, "torch", 1)).__name__)
        print([str(r.source) for r in registry.available() if r.backend == "plugin_backend"])
    ''', str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["OneFileSave plugin_backend 2", "TorchCommonLoadStrategy", "['entry point mine']"]


def test_optional_libraries_are_imported_only_when_used():
    out = _run(f"ZARR_CHECKPOINT = {str(FIXTURES / 'mcore0.10_zarr_w3')!r}\n" + textwrap.dedent('''
        import sys
        sys.modules["zarr"] = None         # as if not installed
        sys.modules["tensorstore"] = None
        import dist_ckpt
        from dist_ckpt import StrategyAction, UnknownStrategyError
        assert "zarr" not in [m for m in sys.modules if sys.modules[m] is not None]
        rows = {(r.action.value, r.backend): r for r in dist_ckpt.list_strategies()}
        print(rows[("load_sharded", "zarr")].importable, rows[("save_sharded", "torch_dist")].importable)
        for action, extra in ((StrategyAction.LOAD_SHARDED, "tensorstore"), (StrategyAction.SAVE_SHARDED, "zarr")):
            try:
                dist_ckpt.get_default_strategy(action, "zarr", 1)
            except UnknownStrategyError as e:
                print(extra in str(e) and f"pip install 'dist_ckpt[{extra}]'" in str(e))
        try:
            dist_ckpt.load_plain_tensors(ZARR_CHECKPOINT)
        except UnknownStrategyError as e:
            print("tensorstore" in str(e))
    '''))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True", "True", "True"]


def test_megatron_core_strategy_helpers(tmp_path):
    from dist_ckpt.serialization import (
        get_default_load_sharded_strategy,
        get_default_save_common_strategy,
        get_default_save_sharded_strategy,
    )

    save = get_default_save_sharded_strategy()
    assert (save.backend, save.version) == ("torch_dist", 1)
    assert get_default_save_sharded_strategy("zarr").backend == "zarr"
    assert get_default_save_common_strategy().backend == "torch"
    assert type(get_default_load_sharded_strategy(FIXTURES / "mcore0.10_zarr_w3")).__name__ == "TensorStoreLoadShardedStrategy"
    assert isinstance(get_default_load_sharded_strategy(FIXTURES / "mcore0.16_torch_dist_w3"), TorchDistLoadShardedStrategy)
    with pytest.raises(dist_ckpt.CheckpointNotFoundError):
        get_default_load_sharded_strategy(tmp_path)

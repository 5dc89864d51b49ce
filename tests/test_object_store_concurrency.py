"""Issue 18 on a real local S3 server (moto's server mode): another tool's checkpoint at the
URL, two writers racing one URL, a reader during a commit, a stalled server, URL roots for the
manager, and the smaller object-store items."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_helpers import run_distributed
from s3_server import moto_server, new_bucket, object_etags, server_pid

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    with moto_server({"DIST_CKPT_CACHE": str(tmp_path_factory.mktemp("cache")),
                      "DIST_CKPT_SCRATCH": str(tmp_path_factory.mktemp("scratch"))}) as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint):
    return new_bucket()


_objects = object_etags


def _state(value: float) -> dict:
    return {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), value)), "v": value}


def _value(loaded: dict) -> float:
    assert float(loaded["w"][0, 0]) == loaded["v"], "a mix of checkpoints"
    return loaded["v"]


@pytest.mark.parametrize("kind", ["dcp", "safetensors"])
def test_a_save_onto_another_tools_checkpoint_at_a_url_is_refused(bucket, tmp_path, kind):
    """18.5 (URLs): the DCP files at the prefix were deleted after the commit before."""
    import boto3

    local = tmp_path / "foreign"
    if kind == "dcp":
        import torch.distributed.checkpoint as dcp

        dcp.save({"model.w": torch.arange(6.0)}, checkpoint_id=str(local))
    else:
        from safetensors.torch import save_file

        local.mkdir()
        save_file({"model.w": torch.arange(6.0)}, str(local / "model.safetensors"))
    client = boto3.client("s3")
    for p in local.iterdir():
        client.upload_file(str(p), bucket, f"run/{p.name}")
    url = f"s3://{bucket}/run"
    before = _objects(bucket)
    for overwrite in (None, False):
        with pytest.raises(dist_ckpt.CheckpointExistsError, match="written by another tool") as info:
            dist_ckpt.save(_state(1.0), url, overwrite=overwrite)
        assert url in str(info.value)
        assert _objects(bucket) == before
    assert torch.equal(dist_ckpt.load_plain_tensors(url)["model.w"], torch.arange(6.0))  # still the foreign one
    dist_ckpt.save(_state(2.0), url, overwrite=True)
    assert _value(dist_ckpt.load(_state(0.0), url)) == 2.0


# -- 18.8: a stalled server -------------------------------------------------------------------------


@contextlib.contextmanager
def _stalled(endpoint: str):
    """The server accepts connections (the kernel does) but answers nothing, as in a partition."""
    pid = server_pid(endpoint)
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _save_to_stalled(rank: int, world: int, url: str, endpoint: str, deadline: float):
    from dist_ckpt.storage.object_store import StorageError

    state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((2, 4), 1.0), (0, rank, world))}
    opts = {"dist_ckpt_deadline_s": deadline}
    start = time.monotonic()
    try:
        dist_ckpt.save(state, url, storage_options=opts)
    except StorageError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "saved", "", time.monotonic() - start


def test_a_stalled_server_fails_loads_and_saves_within_the_deadline(bucket, s3_endpoint):
    """18.8: with the server stopped (SIGSTOP), a load's and a save's storage calls fail after the
    deadline with a StorageError naming the URL, on every rank - not after minutes."""
    from dist_ckpt.storage.object_store import DEFAULT_DEADLINE_S, StorageError

    assert DEFAULT_DEADLINE_S == 60.0
    url = f"s3://{bucket}/ckpt"
    dist_ckpt.save(_state(1.0), url)
    with _stalled(s3_endpoint):
        start = time.monotonic()
        with pytest.raises(StorageError, match="no answer within 3 s") as info:
            dist_ckpt.load_plain_tensors(url, storage_options={"dist_ckpt_deadline_s": 3})
        took = time.monotonic() - start
        assert url in str(info.value) and took < 10, took
        os.environ["DIST_CKPT_STORAGE_DEADLINE_S"] = "2"  # the variable, for calls without storage_options
        try:
            with pytest.raises(StorageError, match="no answer within 2 s"):
                dist_ckpt.load(_state(0.0), url)
        finally:
            del os.environ["DIST_CKPT_STORAGE_DEADLINE_S"]
        results = run_distributed(_save_to_stalled, 2, f"s3://{bucket}/other", s3_endpoint, 3)
    for name, message, seconds in results:
        assert name == "StorageError" and f"s3://{bucket}/other" in message and seconds < 15, results
    assert _value(dist_ckpt.load(_state(0.0), url)) == 1.0  # the server answers again: nothing lost


# -- 18.7: a second writer, and a reader, racing a commit -------------------------------------------

_GATED_WRITER = textwrap.dedent('''
    import os, sys, time, torch, dist_ckpt
    from dist_ckpt import ShardedTensor
    from dist_ckpt.storage import object_store
    url, value, ready, gate = sys.argv[1], float(sys.argv[2]), sys.argv[3], sys.argv[4]
    real_commit = object_store.RemoteSave.commit
    def commit(self, config):  # every object uploaded; the pointer PUT waits for the test
        open(ready, "w").close()
        while not os.path.exists(gate):
            time.sleep(0.01)
        real_commit(self, config)
    object_store.RemoteSave.commit = commit
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 4), value)), "v": value}
    try:
        dist_ckpt.save(state, url)
    except dist_ckpt.CheckpointingException as e:
        print(type(e).__name__, e, flush=True)
        sys.exit(2)
    print("committed", flush=True)
''')


def _wait_for(path: Path, seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while not path.exists():
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.05)


def _race_two_writers(url: str, tmp: Path, values) -> dict:
    """Both writers upload everything and stop before the pointer PUT; A commits, then B tries."""
    procs = {}
    for name, value in zip("AB", values):
        procs[name] = subprocess.Popen([sys.executable, "-c", _GATED_WRITER, url, str(value), str(tmp / f"ready{name}"),
                                        str(tmp / f"gate{name}")], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True)
    for name in "AB":
        _wait_for(tmp / f"ready{name}")
    (tmp / "gateA").touch()
    out_a = procs["A"].communicate(timeout=120)
    (tmp / "gateB").touch()
    out_b = procs["B"].communicate(timeout=120)
    for name in "AB":
        (tmp / f"ready{name}").unlink()
        (tmp / f"gate{name}").unlink()
    return {"A": (procs["A"].returncode, out_a[0]), "B": (procs["B"].returncode, out_b[0] + out_b[1][-2000:])}


def test_two_writers_racing_one_url_exactly_one_commits(bucket, tmp_path):
    """18.7: before, both PUT the pointer, and the winner's cleanup deleted the other's data
    (or the loser's cleanup the winner's): the pointer named deleted objects."""
    from dist_ckpt.storage.object_store import POINTER_FIELD, SAVE_DIR_PREFIX

    url = f"s3://{bucket}/ckpt"
    for round_, values in enumerate([(1.0, 2.0), (3.0, 4.0)]):  # no pointer yet (If-None-Match), then If-Match
        outcome = _race_two_writers(url, tmp_path, values)
        assert outcome["A"] == (0, "committed\n"), outcome
        code, text = outcome["B"]
        assert code == 2 and text.startswith("ConcurrentSaveError") and url in text, outcome
        assert "another writer committed" in text
        assert _value(dist_ckpt.load(_state(0.0), url)) == values[0]  # the winner, whole
        pointer = json.loads(boto3_get(bucket, "ckpt/metadata.json"))
        save_dirs = {k.split("/")[1] for k in _objects(bucket, "ckpt/") if k.startswith(f"ckpt/{SAVE_DIR_PREFIX}")}
        assert pointer[POINTER_FIELD] in save_dirs
        assert len(save_dirs) == 1 + round_  # the loser removed its own objects; the replaced one kept a generation


def boto3_get(bucket: str, key: str) -> bytes:
    import boto3

    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


def test_a_young_save_directory_of_another_writer_survives_a_commit(bucket, tmp_path):
    """The winner's cleanup never removes a save younger than the grace period (B still uploads)."""
    from dist_ckpt.storage.object_store import SAVE_DIR_PREFIX

    url = f"s3://{bucket}/ckpt"
    dist_ckpt.save(_state(1.0), url)
    proc = subprocess.Popen([sys.executable, "-c", _GATED_WRITER, url, "2.0", str(tmp_path / "ready"),
                             str(tmp_path / "gate")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(tmp_path / "ready")
    before = {k.split("/")[1] for k in _objects(bucket, "ckpt/") if k.startswith(f"ckpt/{SAVE_DIR_PREFIX}")}
    for value in (5.0, 6.0):
        dist_ckpt.save(_state(value), url)  # two generations later: everything old would go
    after = {k.split("/")[1] for k in _objects(bucket, "ckpt/") if k.startswith(f"ckpt/{SAVE_DIR_PREFIX}")}
    assert before - after == set() or len(before - after) == 1  # only the first save's directory may go
    young = [d for d in before if d in after]
    assert young, (before, after)  # B's (uploading) directory is still there
    (tmp_path / "gate").touch()
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 2 and out.startswith("ConcurrentSaveError"), (out, err[-2000:])
    assert _value(dist_ckpt.load(_state(0.0), url)) == 6.0


def test_a_reader_during_commits_loads_whole(bucket, monkeypatch):
    """18.7: a reader that read the pointer finishes with that save's objects after one commit
    (replaced data is deleted one generation later); after two commits its objects are gone and
    it reads the pointer again, once."""
    from dist_ckpt.storage import object_store

    monkeypatch.setenv("DIST_CKPT_SAVE_GRACE_S", "0")  # cleanup may remove any directory not kept by generation
    url = f"s3://{bucket}/ckpt"
    real_call = object_store.StoreLocation.call
    proceed = threading.Event()
    waiting = threading.Event()

    def call(self, doing, method, *args, **kwargs):
        if method == "get" and threading.current_thread().name == "reader":
            waiting.set()
            assert proceed.wait(120)
        return real_call(self, doing, method, *args, **kwargs)

    monkeypatch.setattr(object_store.StoreLocation, "call", call)

    def read_while(commits) -> float:
        result = {}
        proceed.clear(), waiting.clear()
        reader = threading.Thread(target=lambda: result.update(path=object_store.local_copy(url)), name="reader")
        reader.start()
        assert waiting.wait(60)  # the reader has read the pointer and is about to download
        for value in commits:
            dist_ckpt.save(_state(value), url)
        proceed.set()
        reader.join(120)
        return _value(dist_ckpt.load(_state(0.0), str(result["path"])))

    dist_ckpt.save(_state(1.0), url)
    dist_ckpt.save(_state(2.0), url)
    assert read_while([3.0]) == 2.0  # the pointer it read still names whole objects
    assert read_while([4.0, 5.0]) == 5.0  # they vanished: the pointer read again


def test_stores_without_conditional_writes_refuse_a_second_writer_by_a_lock_object():
    """memory:// has no conditional PUT: a lock object names the save in flight (best effort)."""
    from dist_ckpt.storage.lock import ConcurrentSaveError
    from dist_ckpt.storage.object_store import begin_remote_save

    url = f"memory://locks-{uuid.uuid4().hex[:8]}/ckpt"
    first = begin_remote_save(url, None, None)
    with pytest.raises(ConcurrentSaveError, match="another save .* is writing"):
        begin_remote_save(url, None, None)
    first.abort()  # its end releases the lock
    second = begin_remote_save(url, None, None)
    second.abort()
    dist_ckpt.save(_state(7.0), url)  # a whole save takes and releases it
    assert _value(dist_ckpt.load(_state(0.0), url)) == 7.0
    dist_ckpt.save(_state(8.0), url)
    assert _value(dist_ckpt.load(_state(0.0), url)) == 8.0


# -- 18.12: a run root given as a checkpoint URL; leftover partial downloads ------------------------


def test_a_url_that_is_a_run_root_is_refused_before_any_download(bucket, monkeypatch):
    from dist_ckpt.storage import object_store
    from dist_ckpt.manager import TRACKER_FNAME

    import boto3

    for step in (100, 200):
        dist_ckpt.save(_state(float(step)), f"s3://{bucket}/run/iter_{step:07d}")
    boto3.client("s3").put_object(Bucket=bucket, Key=f"run/{TRACKER_FNAME}", Body=b"200")
    downloads = []
    real_call = object_store.StoreLocation.call
    monkeypatch.setattr(object_store.StoreLocation, "call",
                        lambda self, doing, method, *a, **k: (downloads.append(method) if method == "get" else None)
                        or real_call(self, doing, method, *a, **k))
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="root of checkpoints .*iter_0000100, iter_0000200") as info:
        dist_ckpt.load(_state(0.0), f"s3://{bucket}/run")
    assert "nothing was downloaded" in str(info.value) and downloads == []
    assert _value(dist_ckpt.load(_state(0.0), f"s3://{bucket}/run/iter_0000200")) == 200.0


def test_leftover_partial_downloads_are_pruned(bucket):
    import hashlib

    from dist_ckpt.storage.object_store import cache_root, open_location

    url = f"s3://{bucket}/ckpt"
    dist_ckpt.save(_state(1.0), url)
    url_dir = cache_root() / hashlib.sha256(open_location(url).url.encode()).hexdigest()[:16]
    stale = url_dir / ".partial-dist_ckpt-save-x-1234abcd"  # a download killed mid-way
    (stale / "sub").mkdir(parents=True)
    (stale / "sub" / "blob").write_bytes(b"x" * 1000)
    dist_ckpt.save(_state(2.0), url)
    assert _value(dist_ckpt.load(_state(0.0), url)) == 2.0
    assert not stale.exists() and not list(url_dir.glob(".partial-*"))


# -- 18.9: an async save to a URL uploads its data in the background --------------------------------


@pytest.mark.parametrize("writer", ["thread", "process"])
def test_async_url_save_uploads_data_in_the_background(bucket, monkeypatch, writer):
    from dist_ckpt.storage import object_store
    from dist_ckpt.strategies.async_utils import AsyncCallsQueue
    from dist_ckpt.strategies.torch_dist import TorchDistSaveShardedStrategy

    puts = []  # (thread name, uploaded names) of this process
    real_call = object_store.StoreLocation.call

    def call(self, doing, method, *args, **kwargs):
        if method == "put":
            puts.append((threading.current_thread().name, [Path(p).name for p in args[0]]))
        return real_call(self, doing, method, *args, **kwargs)

    monkeypatch.setattr(object_store.StoreLocation, "call", call)
    url = f"s3://{bucket}/ckpt"
    queue = AsyncCallsQueue()
    state = {f"t{i}": ShardedTensor.from_rank_offsets(f"t{i}", torch.full((256, 256), float(i))) for i in range(4)}
    state["v"] = 1.0
    request = dist_ckpt.save(state, url, sharded_strategy=TorchDistSaveShardedStrategy(async_writer=writer),
                             async_sharded_save=True)
    queue.schedule_async_request(request)
    while not queue._calls[0].caller.is_current_async_call_done(request):
        time.sleep(0.01)
    finalize_from = len(puts)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    in_finalize = [n for _, names in puts[finalize_from:] for n in names]
    assert in_finalize and not [n for n in in_finalize if n.endswith(".distcp")], puts  # no data while training waits
    assert set(in_finalize) <= {"metadata.json", "common.pt", ".metadata", "dist_ckpt_manifest.json",
                                "dist_ckpt_writer.json"}, in_finalize
    if writer == "thread":
        background = [n for thread, names in puts[:finalize_from] for n in names if thread.startswith("dist_ckpt-async")]
        assert background and all(n.endswith(".distcp") for n in background), puts
    loaded = dist_ckpt.load_plain_tensors(url)
    assert all(torch.equal(loaded[f"t{i}"], torch.full((256, 256), float(i))) for i in range(4))


# -- 18.10: CheckpointManager on an s3:// root ------------------------------------------------------


def test_manager_on_an_s3_root_tracker_listing_retention_rollback(bucket, tmp_path, monkeypatch, capsys):
    """18.10: before, CheckpointManager("s3://bucket/run") wrote to a local directory ./s3:/bucket/run."""
    from dist_ckpt.storage.commit_order import COMMIT_ORDER_FNAME
    from dist_ckpt.manager import TRACKER_FNAME, CheckpointManager, read_tracker

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIST_CKPT_SAVE_GRACE_S", "0")
    root = f"s3://{bucket}/run"
    import boto3

    boto3.client("s3").put_object(Bucket=bucket, Key="run/iter_0000001/notes.txt", Body=b"not ours")
    with CheckpointManager(root, keep_last=2, async_save=True) as mgr:
        for step in (1, 2, 3, 4):
            mgr.save(step, _state(float(step)))
            mgr.maybe_finalize()
    assert not (tmp_path / "s3:").exists()  # nothing local
    assert read_tracker(root) == 4 and boto3_get(bucket, f"run/{TRACKER_FNAME}") == b"4"
    assert mgr.steps() == [3, 4] and mgr.commit_order() == [3, 4]
    keys = set(_objects(bucket, "run/"))
    assert f"run/{COMMIT_ORDER_FNAME}" in keys
    assert not [k for k in keys if k.startswith("run/iter_0000002/")]  # retention removed step 2's objects
    assert [k for k in keys if k.startswith("run/iter_0000001/")] == ["run/iter_0000001/notes.txt"]  # not ours: kept
    # resume, roll back to 3, save 5: the tracker follows the new run
    again = CheckpointManager(root, keep_last=2, async_save=False)
    assert _value(again.load(_state(0.0))) == 4.0 and again.loaded_step == 4
    assert _value(again.load(_state(0.0), step=3)) == 3.0
    again.save(5, _state(5.0))
    assert read_tracker(root) == 5 and again.commit_order() == [4, 5] and again.latest_step() == 5
    again.close()
    # `dist-ckpt ls` of the s3:// root
    from dist_ckpt.tools.cli import main as cli

    capsys.readouterr()
    assert cli(["ls", root]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{root}: 2 checkpoints committed, the tracker names step 5"
    assert [line.split()[:2] for line in lines[2:]] == [["1", "no"], ["4", "committed"], ["5", "committed,"]]
    assert "dist_ckpt" in lines[3] and "dist_ckpt" in lines[4] and lines[4].split()[3] == "tracker's"
    assert cli(["ls", root, "--json"]) == 0
    listing = json.loads(capsys.readouterr().out)
    assert [(c["step"], c["state"], c["files"]) for c in listing["checkpoints"]][0] == (1, "no checkpoint data", 1)
    assert all(c["modified"] is not None and c["bytes"] > 0 for c in listing["checkpoints"])


def test_a_stalled_server_fails_the_managers_save_and_load_within_the_deadline(bucket, s3_endpoint, caplog):
    """18.8 for the manager: with on_error="warn" a save against a stopped server is reported
    once and training goes on; a load raises StorageError naming the URL - within seconds."""
    from dist_ckpt.manager import CheckpointManager
    from dist_ckpt.storage.object_store import StorageError

    root = f"s3://{bucket}/run"
    opts = {"dist_ckpt_deadline_s": 2}
    with CheckpointManager(root, async_save=False) as mgr:  # (a 2 s deadline is for the stalled server only)
        mgr.save(1, _state(1.0))
    mgr = CheckpointManager(root, async_save=True, on_error="warn", storage_options=opts)
    with _stalled(s3_endpoint):
        start = time.monotonic()
        mgr.save(2, _state(2.0))
        mgr.wait()
        assert mgr.failed_steps == [2] and time.monotonic() - start < 20
        start = time.monotonic()
        with pytest.raises(StorageError, match=f"s3://{bucket}/run.*no answer within 2 s"):
            mgr.load(_state(0.0))
        assert time.monotonic() - start < 20
    mgr.close()
    assert _value(CheckpointManager(root).load(_state(0.0))) == 1.0


# -- 18.12: a zarr save to a URL from ranks on several machines --------------------------------------


def _zarr_save_from_two_machines(rank: int, world: int, url: str, scratch: str) -> bool:
    os.environ["DIST_CKPT_SCRATCH"] = f"{scratch}/machine{rank}"  # no scratch directory in common
    state = {"w": ShardedTensor.from_rank_offsets("w", torch.full((4, 8), float(rank + 1)), (0, rank, world)),
             "b": ShardedTensor.from_rank_offsets("b", torch.arange(8.0), replica_id=rank)}
    dist_ckpt.save(state, url, sharded_strategy=("zarr", 1))
    request = {"w": ShardedTensor.from_rank_offsets("w", torch.empty(4, 8), (0, 1 - rank, world)),
               "b": ShardedTensor.from_rank_offsets("b", torch.empty(8), replica_id=rank)}
    loaded = dist_ckpt.load(request, url)
    return torch.equal(loaded["w"], torch.full((4, 8), float(2 - rank))) and torch.equal(loaded["b"], torch.arange(8.0))


def test_zarr_save_to_a_url_from_ranks_on_several_machines(bucket, tmp_path):
    """Before, the ranks of the other machine found no .zarray in their scratch directory."""
    url = f"s3://{bucket}/zarr_ckpt"
    assert run_distributed(_zarr_save_from_two_machines, 2, url, str(tmp_path)) == [True, True]
    keys = _objects(bucket, "zarr_ckpt/")
    assert sum(k.endswith("/w/.zarray") for k in keys) == 1 and sum(k.endswith("/w/0.0") or k.endswith("/w/1.0") for k in keys) == 2


def test_two_exports_racing_to_one_prefix_do_not_mix(bucket, tmp_path, monkeypatch):
    """Two exports to one prefix would upload shard files of the same names over each other
    (their checks for an empty prefix both pass first). The first one claims the prefix while
    it uploads: a second one - even one that checked before the claim - is refused before it
    uploads anything, the first one's files and index land whole, and the claim goes."""
    from safetensors.torch import load_file

    import dist_ckpt.storage.object_store.upload as upload
    from dist_ckpt.storage.lock import ConcurrentSaveError
    from dist_ckpt.tools.export import export_safetensors

    first_src, second_src = tmp_path / "first", tmp_path / "second"
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), 1.0))}, first_src)
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), 2.0))}, second_src)
    url = f"s3://{bucket}/hf"
    uploading, go_on = threading.Event(), threading.Event()
    put = upload._put

    def held_put(*args, **kwargs):
        if threading.current_thread().name == "first-export" and not uploading.is_set():
            uploading.set()
            assert go_on.wait(60)
        return put(*args, **kwargs)

    monkeypatch.setattr(upload, "_put", held_put)
    errors: list = []

    def first_export() -> None:
        try:
            export_safetensors(first_src, url)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    first = threading.Thread(target=first_export, name="first-export")
    first.start()
    try:
        assert uploading.wait(60)
        assert sorted(object_etags(bucket, "hf/")) == ["hf/dist_ckpt-export.json"]
        with pytest.raises(dist_ckpt.CheckpointExistsError, match="holds objects already"):
            export_safetensors(second_src, url)
        # one that found the prefix empty just before the claim: the conditional claim refuses it
        import dist_ckpt.tools.export as export

        for module in (upload, export):
            monkeypatch.setattr(module, "require_empty_prefix", lambda u, o: upload.open_location(u, o))
        with pytest.raises(ConcurrentSaveError, match=f"another export is uploading to {url} right now"):
            export_safetensors(second_src, url)
    finally:
        go_on.set()
        first.join(60)
    assert errors == []
    assert sorted(object_etags(bucket, "hf/")) == ["hf/model-00001-of-00001.safetensors",
                                                   "hf/model.safetensors.index.json"]
    local = tmp_path / "downloaded"
    local.mkdir()
    for name in ("model-00001-of-00001.safetensors", "model.safetensors.index.json"):
        (local / name).write_bytes(_get_object(bucket, f"hf/{name}"))
    assert torch.equal(load_file(local / "model-00001-of-00001.safetensors")["w"], torch.full((64,), 1.0))
    # and one that checked before the claim but claims after the first one ended: its files are there
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="holds objects already"):
        export_safetensors(second_src, url)
    assert "hf/dist_ckpt-export.json" not in object_etags(bucket, "hf/")


def _get_object(bucket: str, key: str) -> bytes:
    import boto3

    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


def test_an_export_to_a_stalled_server_fails_within_the_deadline(bucket, s3_endpoint, tmp_path, monkeypatch, caplog):
    """The server stops answering while an export uploads, after its claim: the export fails with
    a StorageError naming the URL within its deadline, not after minutes, and says it could not
    remove its claim. What the stopped server received still lands when it resumes (a deadline
    ends the wait, not the request), but never the index readers follow, and a second export
    is kept out of the half-written prefix."""
    import dist_ckpt.storage.object_store.upload as upload
    from dist_ckpt.storage.object_store import StorageError
    from dist_ckpt.tools.export import export_safetensors

    src = tmp_path / "src"
    dist_ckpt.save({"w": ShardedTensor.from_rank_offsets("w", torch.full((64,), 1.0))}, src)
    url = f"s3://{bucket}/hf"
    opts = {"dist_ckpt_deadline_s": 2}
    put = upload._put
    stalled = contextlib.ExitStack()

    def put_while_stalled(*args, **kwargs):
        stalled.enter_context(_stalled(s3_endpoint))
        return put(*args, **kwargs)

    monkeypatch.setattr(upload, "_put", put_while_stalled)
    start = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="dist_ckpt"):
            with pytest.raises(StorageError, match="no answer within 2 s") as info:
                export_safetensors(src, url, storage_options=opts)
    finally:
        stalled.close()
    took = time.monotonic() - start
    assert url in str(info.value) and took < 15, took
    assert "dist_ckpt-export.json not removed" in caplog.text
    assert "hf/model.safetensors.index.json" not in object_etags(bucket, "hf/")
    monkeypatch.setattr(upload, "_put", put)
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="holds objects already"):
        export_safetensors(src, url)

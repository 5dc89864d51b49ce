"""Checkpoints at s3:// URLs, against a real local S3 server (moto's server mode, started here).

The server runs as its own process on 127.0.0.1 at a free port; the ranks are real processes
on a gloo group that reach it over HTTP with the standard AWS environment variables.
"""

from __future__ import annotations

import http.server
import json
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import dist_ckpt
from dist_ckpt.tools.cli import main as cli
from dist_ckpt.dict_utils import tensors_bitwise_equal
from dist_ckpt.storage.object_store import POINTER_FIELD, PREVIOUS_FIELD, SAVE_DIR_PREFIX, StorageError
from dist_helpers import one_error, run_distributed
from model_utils import MODEL, global_tensor, sharded_model
from s3_server import free_port, moto_server, new_bucket, object_etags

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    """A moto S3 server process; the AWS variables point every process of the test at it."""
    # grace 0: interrupted saves' leftovers are removed by the next save at once (a grace period
    # protects other writers' uploads; test_object_store_concurrency tests it)
    with moto_server({"DIST_CKPT_CACHE": str(tmp_path_factory.mktemp("cache")),
                      "DIST_CKPT_SCRATCH": str(tmp_path_factory.mktemp("scratch")),
                      "DIST_CKPT_SAVE_GRACE_S": "0"}) as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint):
    return new_bucket()


def _objects(bucket: str, prefix: str = "") -> list:
    return sorted(object_etags(bucket, prefix))


def _save_twice(rank, world, url):
    """A sync save, then an async one of other values (the second must win)."""
    from dist_ckpt.strategies.async_utils import AsyncCallsQueue

    state = sharded_model(rank, world)
    state["iteration"] = 1
    dist_ckpt.save(state, url)
    state = sharded_model(rank, world)
    for sh in dist_ckpt.dict_utils.nested_values(state):
        if isinstance(sh, dist_ckpt.ShardedTensor) and sh.data.dtype.is_floating_point:
            sh.data.add_(1)
    state["iteration"] = 2
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dist_ckpt.save(state, url, async_sharded_save=True))
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return True


def _load_resharded(rank, world, url, saved_world):
    request = sharded_model(rank, world, empty=True)
    if world != saved_world:
        del request["rng"]
    loaded = dist_ckpt.load(request, url)
    assert loaded["iteration"] == 2
    expected = sharded_model(rank, world)
    for (key, got), want in zip(_flat(loaded), _flat(expected)):
        if isinstance(want, dist_ckpt.ShardedTensor):
            want = want.data + 1 if want.data.dtype.is_floating_point else want.data
            assert tensors_bitwise_equal(got, want), key
    return True


def _flat(d, prefix=()):
    if isinstance(d, dict):
        for k in sorted(d, key=str):
            yield from _flat(d[k], prefix + (k,))
    elif isinstance(d, list):
        for i, v in enumerate(d):
            yield from _flat(v, prefix + (i,))
    else:
        yield prefix, d


def test_multi_rank_save_to_s3_and_resharded_loads(bucket, tmp_path, capsys):
    url = f"s3://{bucket}/run/iter_0000002"
    assert run_distributed(_save_twice, 2, url) == [True, True]
    # the layout: the pointer, its save directory and the one it replaced (kept one generation
    # for readers of the previous pointer)
    keys = _objects(bucket)
    pointer = json.loads(_get(bucket, "run/iter_0000002/metadata.json"))
    assert keys == sorted(k for k in keys if k == "run/iter_0000002/metadata.json"
                          or k.startswith(f"run/iter_0000002/{pointer[POINTER_FIELD]}/")
                          or k.startswith(f"run/iter_0000002/{pointer[PREVIOUS_FIELD]}/"))
    assert len({k.split("/")[2] for k in keys if k.count("/") > 2}) == 2
    assert pointer["sharded_backend"] == "torch_dist" and pointer[POINTER_FIELD].startswith(SAVE_DIR_PREFIX)
    assert run_distributed(_load_resharded, 3, url, 2) == [True] * 3
    assert run_distributed(_load_resharded, 1, url, 2) == [True]
    # every load_* function takes the URL
    plain = dist_ckpt.load_plain_tensors(url)
    for key, (shape, dtype) in MODEL.items():
        want = global_tensor(key, shape, dtype)
        assert tensors_bitwise_equal(plain[key], want + 1 if dtype.is_floating_point else want), key
    assert dist_ckpt.load_common_state_dict(url)["iteration"] == 2
    assert set(dist_ckpt.load_tensors_metadata(url)) == set(MODEL)
    assert "rng/shard_0_2" in dist_ckpt.load_sharded_metadata(url)
    # the CLI: validate and inspect
    capsys.readouterr()
    assert cli(["validate", url]) == 0
    assert f"{url}: OK" in capsys.readouterr().out
    assert cli(["inspect", url]) == 0
    out = capsys.readouterr().out
    assert "embedding.weight" in out and "torch_dist" in out
    # convert URL -> URL (zarr) and export URL -> URL (safetensors)
    zarr_url = f"s3://{bucket}/converted"
    assert cli(["convert", url, zarr_url, "--backend", "zarr"]) == 0
    assert dist_ckpt.load_common_state_dict(zarr_url)["iteration"] == 2
    converted = dist_ckpt.load_plain_tensors(zarr_url)
    assert all(tensors_bitwise_equal(converted[k], plain[k]) for k in MODEL)
    capsys.readouterr()
    assert cli(["diff", url, zarr_url]) == 0  # URL against URL, torch_dist against zarr
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(f"same: {len(MODEL)} tensors bit-exact")
    hf_url = f"s3://{bucket}/hf"
    assert cli(["export", url, hf_url, "--max-shard-size", "1KB"]) == 0
    hf_keys = _objects(bucket, "hf/")
    assert "hf/model.safetensors.index.json" in hf_keys and len(hf_keys) > 2
    from safetensors.torch import load as st_load

    exported = {}
    for k in hf_keys:
        if k.endswith(".safetensors"):
            exported.update(st_load(_get(bucket, k)))
    assert sorted(exported) == sorted(MODEL)
    assert all(tensors_bitwise_equal(exported[k], plain[k]) for k in MODEL)
    # an exported HF prefix is itself a source dist_ckpt reads from the URL
    assert all(tensors_bitwise_equal(dist_ckpt.load_plain_tensors(hf_url)[k], plain[k]) for k in MODEL)


def _get(bucket: str, key: str) -> bytes:
    import boto3

    return boto3.client("s3").get_object(Bucket=bucket, Key=key)["Body"].read()


def _put(bucket: str, key: str, body: bytes) -> None:
    import boto3

    boto3.client("s3").put_object(Bucket=bucket, Key=key, Body=body)


def test_overwrite_refusal_nested_checkpoints_and_damaged_objects(bucket, capsys, tmp_path):
    url = f"s3://{bucket}/ckpt"
    state = {"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", torch.arange(6.0))}
    dist_ckpt.save(state, url)
    with pytest.raises(dist_ckpt.CheckpointExistsError, match=f"{url} already holds a committed checkpoint"):
        dist_ckpt.save(state, url, overwrite=False)
    # the parent prefix given by mistake: refused, nothing deleted
    with pytest.raises(dist_ckpt.CheckpointExistsError, match=r"holds other checkpoints \(ckpt\)"):
        dist_ckpt.save(state, f"s3://{bucket}")
    before = _objects(bucket)
    assert any(k.startswith("ckpt/") for k in before)
    # storage_options instead of the AWS_* variables, for a load and for a local -> URL convert and
    # export (one set of options for a call with a local source and a URL target)
    import os

    opts = {"endpoint_url": os.environ["AWS_ENDPOINT_URL"], "key": "testing", "secret": "testing"}
    loaded = dist_ckpt.load({"w": dist_ckpt.ShardedTensor.from_rank_offsets("w", torch.zeros(6))}, url,
                            storage_options=opts)
    assert torch.equal(loaded["w"], torch.arange(6.0))
    local = tmp_path / "local"
    dist_ckpt.save(state, local)
    from dist_ckpt.tools.convert import convert_checkpoint
    from dist_ckpt.tools.export import export_safetensors

    convert_checkpoint(local, f"s3://{bucket}/from_local", "torch_dist", storage_options=opts)
    export_safetensors(local, f"s3://{bucket}/hf_from_local", storage_options=opts)
    with pytest.raises(dist_ckpt.CheckpointExistsError, match="holds objects already"):
        export_safetensors(local, f"s3://{bucket}/hf_from_local", storage_options=opts)
    assert torch.equal(dist_ckpt.load_plain_tensors(f"s3://{bucket}/from_local", storage_options=opts)["w"],
                       torch.arange(6.0))
    assert torch.equal(dist_ckpt.load_plain_tensors(f"s3://{bucket}/hf_from_local", storage_options=opts)["w"],
                       torch.arange(6.0))
    before = _objects(bucket)
    # a damaged data object: validate (which re-downloads) reports it, the load refuses it
    pointer = json.loads(_get(bucket, "ckpt/metadata.json"))[POINTER_FIELD]
    data_key = next(k for k in before if k.startswith("ckpt/") and k.endswith(".distcp"))
    body = bytearray(_get(bucket, data_key))
    body[-9] ^= 0xFF
    _put(bucket, data_key, bytes(body))
    assert cli(["validate", url]) == 1
    assert "INVALID" in capsys.readouterr().out
    with pytest.raises(dist_ckpt.CheckpointingException, match="checksum|hash"):
        dist_ckpt.load_plain_tensors(url)
    # an object the pointer names was deleted by hand: a clear error, not an empty load
    import boto3

    boto3.client("s3").delete_object(Bucket=bucket, Key=f"ckpt/{pointer}/metadata.json")
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="missing its objects"):
        dist_ckpt.load_plain_tensors(url)
    with pytest.raises(dist_ckpt.CheckpointNotFoundError, match="no checkpoint there"):
        dist_ckpt.load_plain_tensors(f"s3://{bucket}/nothing-here")
    assert cli(["inspect", f"s3://{bucket}/nothing-here"]) == 1
    assert capsys.readouterr().err.count("\n") == 1


_KILLED_SAVE = textwrap.dedent('''
    import os, sys, torch
    import dist_ckpt
    from dist_ckpt.storage import object_store
    from dist_ckpt.storage.object_store import upload

    url, moment, value = sys.argv[1], sys.argv[2], float(sys.argv[3])
    state = {f"t{i}": dist_ckpt.ShardedTensor.from_rank_offsets(f"t{i}", torch.full((256, 1024), value))
             for i in range(8)}
    state["value"] = value
    if moment == "mid-upload":  # die after the first of the files went up
        real_put = upload._put
        def put(loc, source, names, under=""):
            real_put(loc, source, names[:1], under)
            os._exit(9)
        upload._put = put
    elif moment == "before-commit":  # every object uploaded, the pointer not yet written
        object_store.RemoteSave.commit = lambda self, config: os._exit(9)
    elif moment == "after-commit":  # the pointer written, the old save's objects not yet removed
        upload._remove_replaced = lambda loc, keep: os._exit(9)
    print("saving", flush=True)
    dist_ckpt.save(state, url)
    print("saved", flush=True)
''')


def _run_save(url: str, moment: str, value: float, kill_after: float = None) -> int:
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_SAVE, url, moment, str(value)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    if kill_after is not None:
        assert proc.stdout.readline().strip() == "saving"
        time.sleep(kill_after)
        proc.send_signal(signal.SIGKILL)
    proc.wait(120)
    return proc.returncode


def _loaded_value(url: str) -> float:
    plain = dist_ckpt.load_plain_tensors(url)
    values = {float(t.reshape(-1)[0]) for t in plain.values()}
    assert len(values) == 1, f"a mix of saves: {values}"
    (value,) = values
    assert all(tensors_bitwise_equal(t, torch.full((256, 1024), value)) for t in plain.values())
    assert dist_ckpt.load_common_state_dict(url)["value"] == value
    return value


def test_killed_save_leaves_the_old_or_the_new_checkpoint(bucket, capsys):
    url = f"s3://{bucket}/ckpt"
    assert _run_save(url, "none", 1.0) == 0
    assert _loaded_value(url) == 1.0
    # deterministic kills at the three moments of the commit protocol
    assert _run_save(url, "mid-upload", 2.0) == 9
    assert _loaded_value(url) == 1.0
    assert _run_save(url, "before-commit", 3.0) == 9
    assert _loaded_value(url) == 1.0
    assert _run_save(url, "after-commit", 4.0) == 9
    assert _loaded_value(url) == 4.0
    # SIGKILL at arbitrary instants of a real save: the old or the new one, never a mix
    last = 4.0
    for i, delay in enumerate([0.3, 0.8, 1.5, 3.0]):
        value = 10.0 + i
        code = _run_save(url, "none", value, kill_after=delay)
        got = _loaded_value(url)
        assert got in (last, value), (delay, got)
        if code == 0:
            assert got == value
        last = got
    # the leftovers of interrupted saves: listed by clean, never the committed save (nor the one
    # it replaced, kept one generation for readers of the previous pointer)
    pointer = json.loads(_get(bucket, "ckpt/metadata.json"))
    capsys.readouterr()
    assert cli(["clean", url]) == 0
    assert _loaded_value(url) == last
    save_dirs = {k.split("/")[1] for k in _objects(bucket, "ckpt/") if k.count("/") > 1}
    assert save_dirs == {pointer[POINTER_FIELD], pointer[PREVIOUS_FIELD]} - {None}
    # and the next save succeeds and leaves exactly two save directories: its own and the previous
    assert _run_save(url, "mid-upload", 20.0) == 9
    assert _run_save(url, "none", 21.0) == 0
    assert _loaded_value(url) == 21.0
    assert len({k.split("/")[1] for k in _objects(bucket, "ckpt/") if k.count("/") > 1}) == 2


class _Refusing(http.server.BaseHTTPRequestHandler):
    """Every request answered 503 (a throttling or broken endpoint)."""

    def _refuse(self):
        self.send_response(503)
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _refuse

    def log_message(self, *args):
        pass


def _save_expecting_storage_error(rank, world, url):
    try:
        dist_ckpt.save(sharded_model(rank, world), url)
    except StorageError as e:
        return str(e)
    return "saved?"


def test_refusing_or_absent_server_is_our_error_naming_the_url(s3_endpoint, monkeypatch, tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Refusing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    refusing = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        url = "s3://bucket/ckpt"
        opts = {"endpoint_url": refusing}
        with pytest.raises(StorageError, match="s3://bucket/ckpt: reading metadata.json failed"):
            dist_ckpt.load_plain_tensors(url, storage_options=opts)
        # a multi-rank save: every rank raises the same error, after bounded retries
        monkeypatch.setenv("AWS_ENDPOINT_URL", refusing)
        messages = run_distributed(_save_expecting_storage_error, 2, url)
        assert one_error(messages).startswith("s3://bucket/ckpt: ")
        # nothing listening at all
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")
        with pytest.raises(StorageError, match="s3://bucket/ckpt: .*Could not connect"):
            dist_ckpt.load_common_state_dict(url)
        assert cli(["validate", url]) == 1
    finally:
        server.shutdown()

"""Issue 18 on a real local S3 server (moto's server mode): another tool's checkpoint at the
URL, two writers racing one URL, a reader during a commit, a stalled server, URL roots for the
manager, and the smaller object-store items."""

from __future__ import annotations

import contextlib
import os
import signal
import time
import uuid

import pytest
import torch

import dist_ckpt
from dist_ckpt import ShardedTensor
from dist_helpers import run_distributed
from s3_server import moto_server, server_pid

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def s3_endpoint(tmp_path_factory):
    with moto_server({"DIST_CKPT_CACHE": str(tmp_path_factory.mktemp("cache")),
                      "DIST_CKPT_SCRATCH": str(tmp_path_factory.mktemp("scratch"))}) as endpoint:
        yield endpoint


@pytest.fixture
def bucket(s3_endpoint):
    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def _objects(bucket: str, prefix: str = "") -> dict:
    """Key -> ETag of every object under ``prefix``."""
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}


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
    from dist_ckpt.object_store import StorageError

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
    from dist_ckpt.object_store import DEFAULT_DEADLINE_S, StorageError

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

"""A real local S3 server for tests: moto's server mode in its own process on 127.0.0.1."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from typing import Dict, Iterator

__all__ = ["free_port", "moto_server", "server_pid", "new_bucket", "object_etags"]

_PIDS: Dict[str, int] = {}  # endpoint -> the server's pid (to stop it with SIGSTOP: a stalled server)


def server_pid(endpoint: str) -> int:
    return _PIDS[endpoint]


def _stopped(pid: int) -> bool:
    """A SIGSTOPped server (a stall test that failed before resuming it) ignores SIGTERM."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "T"
    except OSError:
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def moto_server(extra_env: Dict[str, str] = None) -> Iterator[str]:
    """Start the server, point the AWS_* variables of this process (and the processes it starts)
    at it, yield its endpoint; stop it and restore the variables after."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    endpoint = f"http://127.0.0.1:{port}"
    _PIDS[endpoint] = server.pid
    env = dict(AWS_ENDPOINT_URL=endpoint, AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing",
               AWS_DEFAULT_REGION="us-east-1", **(extra_env or {}))
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        import boto3

        client = boto3.client("s3")
        deadline = time.monotonic() + 60
        while True:
            try:
                client.list_buckets()
                break
            except Exception:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError("the moto S3 server did not start")
                time.sleep(0.2)
        yield endpoint
    finally:
        _PIDS.pop(endpoint, None)
        server.kill() if server.poll() is None and _stopped(server.pid) else server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def new_bucket() -> str:
    """A fresh bucket on the server the AWS variables point at."""
    import uuid

    import boto3

    name = f"ckpt-{uuid.uuid4().hex[:10]}"
    boto3.client("s3").create_bucket(Bucket=name)
    return name


def object_etags(bucket: str, prefix: str = "") -> Dict[str, str]:
    """Key -> ETag of every object under ``prefix``."""
    import boto3

    pages = boto3.client("s3").get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
    return {o["Key"]: o["ETag"] for page in pages for o in page.get("Contents", [])}

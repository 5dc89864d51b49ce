"""The checkpoint writer process that does not import torch (``runtime.writer_process`` starts
it): it maps the staging arenas it is sent and runs write jobs in order.

A job is either a ``PlainWrite`` (a torch_dist save's files, staged in arenas: written by
``plain_files`` with the standard library and xxhash alone) or a pickled call of anything else
(Megatron-Core's write functions, a user's): for those the process imports dist_ckpt and torch
at the first such job, as the writer always did. A process that only writes ``PlainWrite`` jobs
holds about 15 MiB of its own instead of the 200 MiB torch costs.

Messages in (``channel``): ``("init", settings)``, ``("arenas", [(id, nbytes), ...])`` with
their descriptors, ``("job", token, forget, kind, body)``, ``("stop",)``. Out:
``(READY, "ready", pid)``, then for each job ``(token, "started", None)`` and
``(token, "ok", result)`` or ``(token, "error", "Type: message")``.
"""

from __future__ import annotations

import ctypes
import os
import queue
import signal
import socket
import sys
import threading
from typing import Any, Dict, List, Optional, Tuple

from . import arena_table
from .channel import Channel
from .plain_files import write_plain_files

__all__ = ["READY", "WRITER_NICE", "main"]

READY = -1  # the token of the writer's first message: it runs
WRITER_NICE = 19  # the writer yields the CPU to the training loop when both want it
_PR_SET_PDEATHSIG = 1


def _detach(parent_pid: int, die_with_parent: bool) -> None:
    """Ignore Ctrl-C (the training process's to handle), die with the training process, and run
    at the lowest CPU priority (its threads inherit it).

    Dying with the training process: the end of the channel ends the writer at once, even in the
    middle of a write (``_receive``); where the writer was started from the main thread, the
    kernel also kills it when the training process dies (Linux's parent-death signal, which
    follows the starting thread: started from another thread, the writer would die when that
    thread ends)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if die_with_parent:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
        except (OSError, AttributeError):  # not Linux: the end of the channel ends the writer
            pass
    if os.getppid() != parent_pid:  # gone before the prctl took effect
        os._exit(1)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, WRITER_NICE)
    except (OSError, AttributeError):
        pass


def _receive(channel: Channel, inbox: "queue.Queue[Tuple[Any, List[int]]]") -> None:
    """Read messages as they come, so that the training process never waits to send one while
    a write runs. The channel ending before a stop message means the training process is gone
    (it closes its end only after this process ended): nothing of what is being written can be
    committed any more, so the process ends now."""
    try:
        while True:
            message = channel.recv()
            inbox.put(message)
            if message[0][0] == "stop":
                return
    except (EOFError, OSError):
        os._exit(1)


def _with_full_package(settings: Dict[str, Any]) -> None:
    """Replace the placeholder ``dist_ckpt`` package the process started with (it let the
    standalone modules load without the package's ``__init__``, which imports torch) by the
    real one; the standalone modules already loaded stay the same objects."""
    placeholder = sys.modules.get("dist_ckpt")
    if placeholder is not None and getattr(placeholder, "__file__", None) is None:
        sys.path[:] = settings["sys_path"]
        del sys.modules["dist_ckpt"]
        import importlib
        import multiprocessing

        importlib.import_module("dist_ckpt")
        # torch's reductions of CPU tensors fetch their descriptors from the training process,
        # which checks this key (a spawned multiprocessing child is given it the same way)
        multiprocessing.current_process().authkey = settings["authkey"]


def _call(payload: bytes) -> Any:
    import pickle

    fn, args, kwargs = pickle.loads(payload)  # noqa: S301 - our own training process's job
    return fn(*args, **kwargs)


def _send_result(channel: Channel, token: int, result: Any) -> None:
    try:
        channel.send((token, "ok", result))
    except OSError:  # the training process is gone
        raise
    except Exception as e:  # noqa: BLE001 - a result that does not pickle is the job's error
        channel.send((token, "error", f"the write's result could not be sent back: {type(e).__name__}: {e}"))


def main(fd: int, parent_pid: int, die_with_parent: bool) -> None:
    _detach(parent_pid, die_with_parent)
    channel = Channel(socket.socket(fileno=fd))
    inbox: "queue.Queue[Tuple[Any, List[int]]]" = queue.Queue()
    threading.Thread(target=_receive, args=(channel, inbox), name="dist_ckpt-writer-inbox", daemon=True).start()
    settings: Dict[str, Any] = {}
    channel.send((READY, "ready", os.getpid()))
    while True:
        message, fds = inbox.get()
        if message[0] == "stop":
            return
        if message[0] == "init":
            settings = message[1]
            continue
        if message[0] == "arenas":
            for (arena_id, nbytes), arena_fd in zip(message[1], fds):
                arena_table.adopt(arena_id, arena_fd, nbytes)
            continue
        _, token, forget, kind, body = message
        unimportable: Optional[BaseException] = None
        if kind != "plain":  # importing torch is the writer's start, not the job's time
            try:
                _with_full_package(settings)
            except BaseException as e:  # noqa: BLE001 - this job's error
                unimportable = e
        channel.send((token, "started", None))  # the job's timeout counts from here
        try:
            if unimportable is not None:
                raise unimportable
            arena_table.forget(forget)
            result = write_plain_files(body) if kind == "plain" else _call(body)
        except BaseException as e:  # noqa: BLE001 - everything goes back to the training process
            channel.send((token, "error", f"{type(e).__name__}: {e}"))
            continue
        _send_result(channel, token, result)

"""The checkpoint writer process that starts without torch (``standalone.writer_main``), seen
from the training process: started, sent jobs and staging arenas, read for outcomes.

Why not a ``multiprocessing`` child: a spawned child imports torch (to unpickle its target)
and the training script's ``__main__``, about 200-300 MiB of its own on every rank for as long
as training runs; a forked one shares the training state's pages, and every page the training
loop changes is then held twice. This process is ``python -c`` running the standalone modules
under a placeholder ``dist_ckpt`` package (so that the package's ``__init__``, which imports
torch, does not run): about 15 MiB, until a job needs more than a plain write.

The interface is what ``strategies.async_utils.PersistentAsyncCaller`` uses of a
``multiprocessing.Process`` and its two queues: ``pid``, ``is_alive``, ``kill``, ``join``,
``exitcode``; ``jobs.put(message)``; ``results.get(timeout)``, ``get_nowait``, ``put``.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import os
import queue
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any, Optional, Sequence, Tuple

from ..core import CheckpointingException
from ..standalone.channel import MAX_FDS_PER_MESSAGE, Channel

__all__ = ["PlainWriterProcess"]

_PACKAGE_DIR = str(Path(__file__).resolve().parent.parent)

# Run by ``python -c``: the standalone modules under a placeholder ``dist_ckpt`` package.
_BOOTSTRAP = """\
import sys, types
if sys.path and sys.path[0] == "":
    del sys.path[0]
package = types.ModuleType("dist_ckpt")
package.__path__ = [sys.argv[1]]
sys.modules["dist_ckpt"] = package
from dist_ckpt.standalone.writer_main import main
main(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1")
"""


class _Jobs:
    def __init__(self, owner: "PlainWriterProcess") -> None:
        self._owner = owner

    def put(self, message: Any) -> None:
        self._owner.send_job(message)


class _Results:
    """The writer's outcomes, and those the training process adds itself (a job whose
    device copies failed never reaches the writer)."""

    def __init__(self, channel: Channel) -> None:
        self._channel = channel
        self._added: "queue.Queue[Any]" = queue.Queue()
        self._read_lock = threading.Lock()
        self.ended = False  # the writer's end of the channel closed

    def put(self, outcome: Any) -> None:
        self._added.put(outcome)

    def get(self, timeout: Optional[float] = None) -> Any:
        try:
            return self._added.get_nowait()
        except queue.Empty:
            pass
        with self._read_lock:
            if self.ended or not self._channel.readable(0.0 if timeout is None else timeout):
                raise queue.Empty
            try:
                message, _ = self._channel.recv()
            except (EOFError, OSError):
                self.ended = True
                raise queue.Empty from None
        return message

    def get_nowait(self) -> Any:
        return self.get(0.0)


_END = None  # in the outbox: the sending thread ends


class PlainWriterProcess:
    """A started writer process (not waited for: jobs wait in its inbox until it runs).

    Messages go out through a thread of their own (as a ``multiprocessing`` queue's feeder
    does): a job larger than the socket's buffer, sent to a writer that does not read (stopped,
    or stuck in the kernel), would otherwise block the training loop in ``schedule`` for as long;
    now only the job waits, and the write's ``timeout_s`` ends it."""

    name = "dist_ckpt-writer"

    def __init__(self) -> None:
        if not hasattr(socket, "send_fds"):
            raise CheckpointingException(
                "a checkpoint writer process needs Unix sockets that pass descriptors (Linux, macOS); save with "
                "async_writer=\"thread\" (the default) here")
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        main_thread = threading.current_thread() is threading.main_thread()
        try:
            # its own session: a Ctrl-C in the terminal is the training process's to handle
            self._popen = subprocess.Popen(
                [multiprocessing.spawn.get_executable(), "-c", _BOOTSTRAP, _PACKAGE_DIR, str(theirs.fileno()),
                 str(os.getpid()), "1" if main_thread else "0"],
                pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            theirs.close()
        self._channel = Channel(ours)
        self.jobs = _Jobs(self)
        self.results = _Results(self._channel)
        self._outbox: "queue.Queue[Optional[Tuple[Any, ...]]]" = queue.Queue()
        self._outbox.put(("init", {"sys_path": list(sys.path),
                                   "authkey": bytes(multiprocessing.current_process().authkey)}))
        threading.Thread(target=self._send_all, name="dist_ckpt-writer-outbox", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._popen.pid

    @property
    def exitcode(self) -> Optional[int]:
        return self._popen.poll()

    def is_alive(self) -> bool:
        return self._popen.poll() is None

    def kill(self) -> None:
        if self.is_alive():
            self._popen.kill()
        self._outbox.put(_END)

    def join(self, timeout: Optional[float] = None) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def send_job(self, message: Optional[Tuple[Any, ...]]) -> None:
        """Queue a message for the writer (it is sent by the outbox thread, in order). None: stop
        once the jobs before are done. Else ``(token, forget, arenas, kind, body)``: the arenas
        (``(id, nbytes, fd)``: a duplicate descriptor the message owns, closed once passed) the
        writer does not hold yet go first."""
        self._outbox.put(("stop",) if message is None else ("job",) + tuple(message))

    def _send_all(self) -> None:
        """The outbox thread: every message in order, until a stop is sent or the writer is
        gone (a message that cannot be sent then only closes its descriptors: the pending jobs
        fail once the caller sees the writer gone)."""
        alive = True
        while True:
            message = self._outbox.get()
            if message is _END:  # killed: what is left is never sent
                self._close_descriptors()
                return
            if message[0] != "job":
                alive = alive and self._send(message)
                if message[0] == "stop":
                    return
                continue
            _, token, forget, arenas, kind, body = message
            try:
                for start in range(0, len(arenas), MAX_FDS_PER_MESSAGE):
                    batch = arenas[start: start + MAX_FDS_PER_MESSAGE]
                    alive = alive and self._send(("arenas", [(arena_id, nbytes) for arena_id, nbytes, _ in batch]),
                                                 [fd for _, _, fd in batch])
            finally:
                for _, _, fd in arenas:
                    os.close(fd)
            alive = alive and self._send(("job", token, forget, kind, body))

    def _close_descriptors(self) -> None:
        while True:
            try:
                message = self._outbox.get_nowait()
            except queue.Empty:
                return
            if message is not _END and message[0] == "job":
                for _, _, fd in message[3]:
                    os.close(fd)

    def _send(self, message: Tuple[Any, ...], fds: Sequence[int] = ()) -> bool:
        """Whether the message was sent (False: the writer is gone)."""
        try:
            self._channel.send(message, fds)
        except OSError:
            return False
        return True

"""Messages between the training process and its writer process: pickled plain values over a
Unix socket, with file descriptors (staging arenas) passed beside them (``SCM_RIGHTS``)."""

from __future__ import annotations

import pickle
import select
import socket
import struct
import threading
from typing import Any, List, Sequence, Tuple

__all__ = ["Channel", "MAX_FDS_PER_MESSAGE"]

_HEADER = struct.Struct("<QI")  # payload length, number of descriptors passed with the header
MAX_FDS_PER_MESSAGE = 200  # the kernel takes at most 253 per message (SCM_MAX_FD)


class Channel:
    """One end of the socket. ``send`` is safe from several threads; ``recv`` is one reader's."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self._send_lock = threading.Lock()

    def send(self, message: Any, fds: Sequence[int] = ()) -> None:
        if len(fds) > MAX_FDS_PER_MESSAGE:
            raise ValueError(f"at most {MAX_FDS_PER_MESSAGE} descriptors per message, got {len(fds)}")
        payload = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        header = _HEADER.pack(len(payload), len(fds))
        with self._send_lock:
            if fds:
                socket.send_fds(self.sock, [header], list(fds))
            else:
                self.sock.sendall(header)
            self.sock.sendall(payload)

    def readable(self, timeout_s: float) -> bool:
        """Whether a message (or the end of the stream) is there within ``timeout_s``."""
        return bool(select.select([self.sock], [], [], max(0.0, timeout_s))[0])

    def recv(self) -> Tuple[Any, List[int]]:
        """The next message and the descriptors sent with it (blocking); ``EOFError`` when the
        other end is gone."""
        header, fds, _, _ = socket.recv_fds(self.sock, _HEADER.size, MAX_FDS_PER_MESSAGE)
        if not header:
            raise EOFError("the other end of the checkpoint writer's channel closed")
        header += self._exactly(_HEADER.size - len(header))
        length, count = _HEADER.unpack(header)
        if len(fds) != count:
            raise EOFError(f"expected {count} descriptors with a message, got {len(fds)}")
        return pickle.loads(self._exactly(length)), list(fds)  # noqa: S301 - our own process's message

    def _exactly(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(min(left, 1 << 24))
            if not chunk:
                raise EOFError("the other end of the checkpoint writer's channel closed mid-message")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def close(self) -> None:
        self.sock.close()

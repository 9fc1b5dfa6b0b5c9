"""The ZMQ sockets between the HTTP process, the scheduler and the detokenizer (the messages they carry:
scheduler/io_struct.py).

Sockets are `ipc://` paths inside a private 0700 folder, never TCP: whoever can write to the scheduler's
socket runs the server.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq


@dataclass(frozen=True)
class IpcPaths:
    """The socket folder and the three endpoints; created private (0700) and removed at exit."""

    folder: str

    @classmethod
    def create(cls) -> IpcPaths:
        folder = tempfile.mkdtemp(prefix="duet-ipc-")  # mkdtemp makes it 0700 and owned by us
        os.chmod(folder, 0o700)
        return cls(folder)

    def _endpoint(self, name: str) -> str:
        return f"ipc://{Path(self.folder) / name}"

    @property
    def scheduler_input(self) -> str:
        return self._endpoint("scheduler_in")

    def scheduler_input_of(self, dp_rank: int) -> str:
        """Data-parallel replica dp_rank's scheduler (replica 0's is scheduler_input)."""
        return self.scheduler_input if dp_rank == 0 else self._endpoint(f"scheduler_in_dp{dp_rank}")

    @property
    def detokenizer_input(self) -> str:
        return self._endpoint("detokenizer_in")

    @property
    def http_input(self) -> str:
        return self._endpoint("http_in")

    def remove(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


def bind_pull(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PULL)
    sock.bind(endpoint)
    return sock


def connect_push(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    return sock

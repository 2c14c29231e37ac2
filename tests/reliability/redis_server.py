"""A real `redis-server` the Redis tier's tests start themselves: on a free localhost port, in a temp folder,
persisting nothing (`--save '' --appendonly no`). It can be killed, restarted on the same port, and paused
(SIGSTOP: connections are accepted by the kernel but never answered, i.e. a hung server)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def why_no_redis() -> str | None:
    """None when a server can be started here, else the reason."""
    try:
        import redis  # noqa: F401
    except ImportError:
        return "the redis package is missing (pip install 'kvfuse[redis]')"
    if shutil.which("redis-server") is None:
        return "redis-server is not installed (apt-get install redis-server)"
    return None


class RedisServer:
    def __init__(self, folder: Path, port: int | None = None) -> None:
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self):
        import redis

        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        log = open(self.folder / "server.log", "ab")
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.folder), "--daemonize", "no"],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}: "
                                   f"{(self.folder / 'server.log').read_text(errors='replace')[-500:]}")
            with contextlib.suppress(Exception):
                if self.client().ping():
                    return self
            time.sleep(0.05)
        self.kill()
        raise RuntimeError(f"redis-server did not answer on port {self.port} within {timeout_s} s")

    def kill(self) -> None:
        """SIGKILL (no shutdown, nothing flushed), and waits for the process."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def pause(self) -> None:
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def flush(self) -> None:
        self.client().flushall()

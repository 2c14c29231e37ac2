"""Helpers of the server tests: the real server as a subprocess (`launch`), the router over replicas
(`launch_router`), test documents, the API key."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

KEY = "test-key"
DOCS = [
    {"id": "lark", "title": "Larkspur Observatory",
     "text": "The Larkspur Observatory was built in 1887 on the slopes above the old harbour town of Dunmore."},
    {"id": "voss", "text": "Its first director, Amelia Voss, was born in Dunmore and spent forty years measuring "
                           "the motion of double stars."},
    {"id": "quillon", "text": "The Quillon festival was founded in 1923 by Tomas Reyes; every spring the streets "
                              "fill with lanterns, music and the smell of roasted chestnuts."},
]


def missing_deps() -> list[str]:
    import importlib.util

    return [m for m in ("fastapi", "uvicorn", "prometheus_client", "openai", "httpx")
            if importlib.util.find_spec(m) is None]


def threads() -> int:
    import torch

    return torch.get_num_threads()


class Server:
    def __init__(self, proc: subprocess.Popen, url: str, model: str, log_path: Path) -> None:
        self.proc, self.url, self.model, self.log_path = proc, url, model, log_path

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


def launch(model_dir: Path, *args: str, timeout: float = 120.0) -> Server:
    """Starts `kvfuse serve` on port 0 and waits for its address line and for /health."""
    cache = tempfile.mkdtemp(prefix="kvfuse-serve-test-")
    cmd = ["serve", "--model", str(model_dir), "--device", "cpu", "--dtype", "fp32", "--cache-dir", cache,
           "--threads", str(threads()), "--port", "0", *args]
    return _spawn(cmd, Path(cache), timeout)


def launch_router(replicas: list[str], *args: str, timeout: float = 60.0) -> Server:
    """Starts `kvfuse route` over `replicas` on port 0 and waits for its address line and for /health."""
    where = tempfile.mkdtemp(prefix="kvfuse-route-test-")
    cmd = ["route", "--port", "0", *[a for url in replicas for a in ("--replica", url)], *args]
    return _spawn(cmd, Path(where), timeout)


def _spawn(cli_args: list[str], folder: Path, timeout: float) -> Server:
    import httpx

    log_path = folder / "server.log"
    log = open(log_path, "w")
    env = dict(os.environ, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "kvfuse.cli", *cli_args], stdout=subprocess.PIPE, stderr=log,
                            text=True, env=env)
    found: list[str] = []

    def read() -> None:  # the first stdout line names the address; later lines are drained
        for line in proc.stdout:
            if not found and " on http://" in line:
                found.append(line.strip().rsplit(" on ", 1)[1])

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not found:
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server did not start (exit {proc.poll()}):\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    url = found[0]
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the server never became healthy:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)
    model = httpx.get(f"{url}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()["data"][0]["id"]
    return Server(proc, url, model, log_path)

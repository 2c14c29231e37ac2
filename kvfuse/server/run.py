"""Serving the app with uvicorn: one bound socket, SIGTERM / SIGINT drain then stop."""
from __future__ import annotations

import contextlib
import socket
import sys

import uvicorn

__all__ = ["serve"]


class _Server(uvicorn.Server):
    """uvicorn's server, telling the app to refuse new requests (503) as soon as a stop signal arrives.

    uvicorn then stops accepting connections and waits for the responses in flight (streams included); the app
    cancels the requests still running `shutdown_timeout` seconds after the signal (their clients get an error
    event or a 503), so they end through the app; uvicorn's own timeout, 30 s later, is only a backstop (on a busy
    machine a 5 s margin let it cancel a stream first and log a traceback).
    The app's lifespan end then shuts the engine down."""

    def __init__(self, config: uvicorn.Config, state, shutdown_timeout: float) -> None:
        super().__init__(config)
        self._state, self._timeout = state, shutdown_timeout

    def handle_exit(self, sig, frame) -> None:
        if not self._state.draining:
            self._state.start_draining(cancel_after_s=self._timeout)
        super().handle_exit(sig, frame)

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises the stop signal once it is done; a drained server exits with status 0 instead
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def serve(app, *, host: str = "127.0.0.1", port: int = 8000, shutdown_timeout: float = 30.0,
          log_level: str = "warning") -> None:
    """Serves `app` (from `create_app`) until SIGTERM / SIGINT. Port 0 picks a free port; the address served is
    printed on stdout as `kvfuse: serving <model> on http://host:port`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    bound = sock.getsockname()[1]
    config = uvicorn.Config(app, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout + 30.0,
                            lifespan="on", access_log=log_level in ("debug", "info"))
    server = _Server(config, app.state.kvfuse, shutdown_timeout)
    where = f"[{host}]" if family == socket.AF_INET6 else host
    print(f"kvfuse: serving {app.state.kvfuse.model_name} on http://{where}:{bound}", flush=True)
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    print("kvfuse: stopped", file=sys.stderr, flush=True)

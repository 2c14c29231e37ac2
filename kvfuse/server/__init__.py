"""`kvfuse serve`: an OpenAI-compatible HTTP server over a FusionEngine (needs the `serve` extra).

    from kvfuse.server import create_app, serve
    serve(create_app(engine, api_key="..."), host="127.0.0.1", port=8000)
"""
from __future__ import annotations

from .app import create_app
from .run import serve

__all__ = ["create_app", "serve"]

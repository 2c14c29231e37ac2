"""`kvfuse serve`: an OpenAI-compatible HTTP server over a FusionEngine (needs the `serve` extra).

    from kvfuse.server import create_app, serve
    serve(create_app(engine, api_key="..."), host="127.0.0.1", port=8000)

Several replicas behind one front (`kvfuse route`): `create_router_app(["http://a:8000", "http://b:8000"])`.
"""
from __future__ import annotations

from .app import create_app
from .router import create_router_app
from .run import serve

__all__ = ["create_app", "create_router_app", "serve"]

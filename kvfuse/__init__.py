"""kvfuse: fast retrieval-augmented generation from fused per-document KV caches.

Logging: everything logs under the `kvfuse` logger (`kvfuse.store`, `kvfuse.weights`, ...). As a library,
kvfuse attaches only a NullHandler to it, so nothing is printed unless the application configures logging,
e.g. `logging.basicConfig(level=logging.INFO)` or a handler on `logging.getLogger("kvfuse")`. The `kvfuse`
command line prints the warnings itself, on stderr.
"""
import logging

logging.getLogger("kvfuse").addHandler(logging.NullHandler())

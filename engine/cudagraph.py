"""One way to capture a CUDA graph: warm up on a side stream, then capture (used by every graph in the engine)."""
from __future__ import annotations

import torch

__all__ = ["capture_graph"]


def capture_graph(fn, device, pool=None):
    """(graph, fn's outputs as the graph's static outputs).

    `fn` runs once on a side stream first (allocator, cuBLAS workspaces, Triton compilation), then is captured.
    `pool`: a `torch.cuda.graph_pool_handle()` shared with other graphs (None: the graph's own pool).
    """
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out

"""One way to capture a CUDA graph: warm up on a side stream, then capture (used by every graph in the engine)."""
from __future__ import annotations

import dataclasses

import torch

__all__ = ["KEEP_WARM", "capture_graph", "capture_graph_keeping_warm"]

# Whether the request that captures a graph answers from the capture's warm-up run (computed once) instead of
# replaying the new graph on top (computed twice). The default of both graph caches (`LayoutGraphs.keep_warm` in
# engine/bucketed.py, the exact-layout cache in engine/runner.py); tests/engine/test_gpu_paths.py checks it on CUDA.
KEEP_WARM = True


def capture_graph(fn, device, pool=None):
    """(graph, fn's outputs as the graph's static outputs).

    `fn` runs once on a side stream first (allocator, cuBLAS workspaces, Triton compilation), then is captured.
    `pool`: a `torch.cuda.graph_pool_handle()` shared with other graphs (None: the graph's own pool).
    """
    graph, out, _ = capture_graph_keeping_warm(fn, device, pool)
    return graph, out


def capture_graph_keeping_warm(fn, device, pool=None, clock=None):
    """(graph, static outputs, the warm-up run's outputs).

    As `capture_graph`, and the warm-up run's own outputs are returned too, usable on the current stream: when
    `fn` computes a request, its warm-up run *is* that request's result, so the request that captures a graph
    need not replay it as well (capturing only records the kernels; the warm-up ran them). Every tensor among
    the warm outputs (through tuples, lists, dicts and dataclasses) is marked as used by the current stream
    (`record_stream`), so the allocator does not hand its memory to later side-stream work before the current
    stream's reads are done. `clock` (start / stop on the current stream): brackets the warm-up run alone, not the
    recording.
    """
    cur = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    if clock is not None:
        clock.start()
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        warm = fn()
    cur.wait_stream(side)
    if clock is not None:
        clock.stop()
    _record(warm, cur)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out, warm


def _record(obj, stream) -> None:
    if isinstance(obj, torch.Tensor):
        if obj.is_cuda:  # a host tensor among the outputs has no stream to record
            obj.record_stream(stream)
    elif isinstance(obj, (tuple, list)):
        for x in obj:
            _record(x, stream)
    elif isinstance(obj, dict):
        for x in obj.values():
            _record(x, stream)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            _record(getattr(obj, f.name), stream)

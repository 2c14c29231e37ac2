"""CPU intra-op threads of one thread, leaving every other thread's as they are.

An engine on a GPU keeps its scheduler thread's own tensor work on the host small (bucket plans, index sets,
token ids), and it sits on the TTFT path. PyTorch runs such CPU ops on its intra-op pool (OpenMP, one thread per
core); for tensors of a few ten thousand elements, waking that pool costs more than the op. Measured on an H200
host (16 cores; `benchmarks/ttft_jitter.py`, 0.5B shape, 8k context, new random layouts; docs/gpu/host_threads_1204):
with the default pool the bucket plan took 8.4 ms median and up to 23 ms (infoflow), and one call in five took
10-15 ms longer than the rest; on one thread it takes 0.4-0.6 ms, and first-sight TTFT fell from 20.8 to 12.2 ms
median (infoflow) and from 5.9 to 4.4 ms median, 15.4 to 4.8 ms p90 (reuse). So the scheduler thread of a GPU
engine runs its CPU ops on one thread.

`torch.set_num_threads` sets the calling thread's count *and* the default that threads initialised later take (a
thread takes it at its first parallel op). `set_own_threads` keeps the change to the calling thread: it
initialises the thread's count first, sets it, then gives the default back from a short-lived helper thread.
A thread that initialises in between (microseconds) would take the new count.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch

__all__ = ["default_threads", "set_own_threads", "process_threads"]

_narrowed = threading.local()  # .default: the process default, on a thread whose count set_own_threads changed


def _on_fresh_thread(fn: Callable[..., Any], *args: Any) -> Any:
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), name="kvfuse-threads", daemon=True)
    t.start()
    t.join()
    return out[0]


def default_threads() -> int:
    """The intra-op count a thread started now takes (the process default, or what `torch.set_num_threads` last
    made it)."""
    return _on_fresh_thread(torch.get_num_threads)


def set_own_threads(n: int) -> int:
    """Sets the calling thread's intra-op CPU thread count to `n`; other threads, and threads started later, keep
    theirs. Returns the calling thread's previous count.

    Raises:
        ValueError: n < 1.
    """
    if n < 1:
        raise ValueError(f"a thread count must be >= 1, got {n}")
    own = torch.get_num_threads()  # also initialises this thread's count: from here on it is its own
    if own == n:
        return own
    default = default_threads()
    torch.set_num_threads(n)  # this thread's count, and (as a side effect) the default of later threads ...
    _on_fresh_thread(torch.set_num_threads, default)  # ... which is put back
    _narrowed.default = default
    return own


@contextlib.contextmanager
def process_threads() -> Iterator[None]:
    """`with process_threads():` CPU-heavy work on a thread whose count `set_own_threads` changed (a GPU engine's
    scheduler thread) runs on the process default, then the thread's own count is back. On any other thread it
    changes nothing and costs nothing."""
    default = getattr(_narrowed, "default", None)
    if default is None or torch.get_num_threads() == default:
        yield
        return
    prev = set_own_threads(default)
    try:
        yield
    finally:
        set_own_threads(prev)

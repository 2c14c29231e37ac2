"""`sift` (SIFT, arXiv 2606.09441): no K/V reuse; every token computed, attention sparse by per-document indexes.

The engine does the work (engine/sift.py): it looks up (or computes) each document's selective index, builds one
list of key blocks per query block per layer, and hands it to the runner as `sparse_plan`; the runner's plain
prefill then calls the block-sparse kernel instead of dense causal attention. The ratio is ignored.
"""
from __future__ import annotations

import copy

from ..sift import check_modes
from .base import SelectContext, Strategy, register


@register
class Sift(Strategy):
    name = "sift"
    uses_cache = False
    ignores_ratio = True
    graph_safe = False  # the block lists change per request
    sparse_index = True

    ON_MISS = ("dense", "compute")

    def __init__(self, block: int = 16, local_mass: float = 0.8, cross_mass: float = 0.5,
                 kernel_block: int | None = None, on_miss: str = "dense", window: int = 0,
                 cross: str = "pick", local: str = "marks", heads: str = "shared", max_density: float = 0.5,
                 min_tokens: int | None = None) -> None:
        """
        Args:
            block: tokens per block of the index (document-local).
            local_mass / cross_mass: attention mass the local / cross marks must cover, in (0, 1].
            kernel_block: the kernel's block size (default: 64 on CUDA, 16 elsewhere).
            on_miss: a document with no index yet. "dense" (default): it attends densely in this request, a full
                prefill's cost and answer, and its index is built when the engine is next idle (counted in
                `extra["sift"]["index_deferred"]`), so a new document never waits for its index. "compute": the
                index is built before the prefill (one extra pass over the document on the request's path).
            window: a dense local window in tokens (0: a query's own kernel block and the one before only): every
                query also attends to the `window` tokens before its block, whatever the marks say. Applied when
                the request's block lists are built, so indexes do not depend on it.
            cross: which earlier-document blocks a document's queries see. "pick" (default): as many blocks as
                the earlier documents' cross marks would open, chosen per request and layer from block-mean queries
                and keys (`engine.sift.CrossPick`; on the embedded model KL to full prefill lower on all four dev
                QA sets at the same density, ~1% of TTFT at 32k on the GPU: docs/quality/sift_coinrag.md).
                "marks": the cross marks themselves (the paper's cross-attention consistency). Indexes do not
                depend on it.
            local: which of a document's own blocks (beyond the window) its queries see. "marks" (default): the
                indexes' local marks. "pick": chosen per request like the cross blocks; with cross="pick" the two
                share one pool (as many blocks per query block as the marks would open, wherever the estimate puts
                them).
            heads: "shared" (default): picked blocks are one list for every head; "kv": each KV head picks its own
                (the same count; lists per KV head in the kernel). Needs cross or local "pick". Measured on the
                embedded model: no less attention mass dropped, KL to full prefill ~3x higher
                (docs/quality/sift_coinrag.md).
            max_density / min_tokens: when the sparse kernel runs. A request whose plan keeps more than `max_density`
                of the causal block pairs, or whose prompt has fewer than `min_tokens` tokens (None: 4 x the model's
                hidden size), attends densely: a full prefill's cost and answer, reported in `extra["sift"]` as
                `sparse: False` with the reason. Measured on the H200 (docs/gpu/README.md, SIFT and the launch
                sweep): the block-sparse kernel does a useful FLOP at 0.74x of dense flash attention's speed at 32k
                keys and 0.57x at 8k (0.6x before its launch change), so it gains little above about half density,
                and sift's plan costs more than the attention it saves at 8k on the 8B shape (0.94x of `full`) while
                it gains at 32k (1.20x) and 64k (1.39x); the attention's share of a prefill grows with the prompt's
                length over the hidden size, hence the bound in hidden sizes. Pass min_tokens=0 and max_density=1
                to run the sparse kernel on every request.
        """
        if on_miss not in self.ON_MISS:
            raise ValueError(f"on_miss must be one of {self.ON_MISS}, got {on_miss!r}")
        for name, x in (("local_mass", local_mass), ("cross_mass", cross_mass)):
            if not 0.0 < float(x) <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {x}")
        if not 0.0 < float(max_density) <= 1.0:
            raise ValueError(f"max_density must be in (0, 1], got {max_density}")
        if min_tokens is not None and int(min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0 (or None), got {min_tokens}")
        if int(window) < 0:
            raise ValueError(f"window must be >= 0 tokens, got {window}")
        check_modes(cross, local, heads)
        if int(block) < 1:
            raise ValueError(f"block must be >= 1, got {block}")
        if kernel_block is not None and (int(kernel_block) < 16 or int(kernel_block) & (int(kernel_block) - 1)):
            raise ValueError(f"kernel_block must be a power of two >= 16, got {kernel_block}")
        self.block = int(block)
        self.local_mass = float(local_mass)
        self.cross_mass = float(cross_mass)
        self.kernel_block = None if kernel_block is None else int(kernel_block)
        self.on_miss = on_miss
        self.window = int(window)
        self.cross = cross
        self.local = local
        self.heads = heads
        self.max_density = float(max_density)
        self.min_tokens = None if min_tokens is None else int(min_tokens)
        self.sparse_plan = None  # set on a request's own copy (`bound`): (per-layer lists, counts, kernel block)

    def bound(self, plan) -> "Sift":
        """This strategy for one request: a copy holding the request's sparse plan (what the runner reads). The
        instance a caller passes is never changed, so concurrent requests may share it."""
        run = copy.copy(self)
        run.sparse_plan = plan
        return run

    def index_params(self) -> str:
        """What an index depends on besides the document (part of its key)."""
        return f"sift|b={self.block}|l={self.local_mass!r}|c={self.cross_mass!r}"

    def initial(self, ctx: SelectContext):
        return ctx.candidates

    def describe(self) -> str:
        return self.name

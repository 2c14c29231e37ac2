"""Offline profiling for the query-aware strategies, and the selection-only pass the engine runs for them.

- Critical layers of a model (`profile_layers`, CLI `kvfuse profile-layers`): on a few calibration examples,
  every layer is tried alone as the selector (the question probe's attention at that layer, averaged over question
  rows, picks the top `ratio` of the cached document tokens) and scored by the KL divergence, teacher forced over
  the full-prefill answer, between the fused result and full prefill. The `top` layers with the lowest mean KL
  are the model's critical layers. They are stored as JSON under `<cache dir>/profiles/<model fingerprint>.json`
  (`profile_path`) and handed to strategies that ask for them (`qcfuse`) by `load_profile`.
- Document anchors (`AnchorProfiler`, extras name "anchors"): a document's digest for `qcfuse`, computed from its
  stored cache: the first `sinks` tokens plus the `ratio` share of tokens that receive the most attention from a
  strided sample of the document's own rows (recomputed exactly over its cache) at the critical layers.
- `select_only` / `reorder_documents` (engine/fusion/select.py, re-exported here): a strategy's probe and
  `initial` over a prepared prompt and nothing after (the anchor profiler uses it).

The profilers receive the engine's DocumentCache (engine/doccache.py), or an engine (its `doc_cache` is used).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from .fusion.base import SelectContext, Strategy, budget_for, topk_positions
from .fusion.qattn import layer_mean
from .fusion.qcfuse import default_critical_layers
from .fusion.select import reorder_documents, select_only
from .store.entry import DocKV

__all__ = ["select_only", "reorder_documents", "AnchorProfiler", "SingleLayerProbe", "profile_layers",
           "profile_path", "load_profile", "save_profile", "critical_layers_for"]

PROFILE_VERSION = 1


# -- model profiles (critical layers) -------------------------------------------------------------------------
def _profiles_dir(engine) -> Path:
    disk = getattr(engine.config, "disk_cache_dir", None)
    if disk is not None:
        return Path(disk).parent / "profiles"
    from .weights import default_cache_dir

    return default_cache_dir() / "profiles"


def profile_path(engine) -> Path:
    """Where the profile of the engine's model lives: `<cache dir>/profiles/<model fingerprint>.json`."""
    return _profiles_dir(engine) / f"{engine.namespace.model}.json"


_LOADED: dict[str, tuple[float, dict | None]] = {}


def load_profile(engine) -> dict | None:
    """The stored profile of the engine's model, or None (re-read only when the file changes)."""
    path = profile_path(engine)
    try:
        mtime = path.stat().st_mtime
    except OSError:
        return None
    hit = _LOADED.get(str(path))
    if hit is not None and hit[0] == mtime:
        return hit[1]
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("version") != PROFILE_VERSION or data.get("fingerprint") != engine.namespace.model:
            data = None
    except (OSError, ValueError):
        data = None
    _LOADED[str(path)] = (mtime, data)
    return data


def save_profile(engine, profile: dict) -> Path:
    path = profile_path(engine)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(profile, indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path


def critical_layers_for(engine) -> tuple[int, ...]:
    """The model's profiled critical layers, else the default (1/4, 1/2, 3/4 of the depth)."""
    n = engine.decoder.spec.n_layers
    prof = load_profile(engine)
    layers = (prof or {}).get("critical_layers")
    if layers and all(0 <= int(x) < n for x in layers):
        return tuple(sorted({int(x) for x in layers}))
    return default_critical_layers(n)


class SingleLayerProbe(Strategy):
    """Selector of one layer: question attention at `layer` (mean over question rows), top budget."""

    name = "single-layer-probe"

    def __init__(self, layer: int) -> None:
        self.layer = int(layer)

    def probe_layers(self, n_layers: int):
        return (self.layer,)

    def initial(self, ctx: SelectContext):
        return topk_positions(layer_mean(ctx, (self.layer,), "mean"), ctx.candidates, ctx.budget)


def _kl(ref_lp: torch.Tensor, lp: torch.Tensor) -> float:
    """Mean over rows of KL(ref || other) from log-probabilities [T, V]."""
    p = ref_lp.exp()
    return float((p * (ref_lp - lp)).sum(-1).clamp_min(0).mean())


def profile_layers(engine, examples, *, ratio: float = 0.15, top: int = 3, max_new_tokens: int = 8,
                   progress=None) -> dict:
    """Finds the engine's model's critical layers on calibration examples (see the module doc).

    Args:
        examples: [(question, docs)] with docs as `generate` takes them.
        ratio: recompute ratio of the single-layer selectors.
        top: how many critical layers to keep.
        max_new_tokens: length of the full-prefill answer the KL is teacher forced over.
        progress: optional callable(str) for one line per example.
    Returns:
        the profile dict (also what `save_profile` writes).
    """
    n_layers = engine.decoder.spec.n_layers
    if not examples:
        raise ValueError("profiling needs at least one calibration example")
    kl = torch.zeros(n_layers, dtype=torch.float64)
    reuse_kl = 0.0
    t0 = time.perf_counter()
    for i, (question, docs) in enumerate(examples):
        engine.precompute(docs)
        ref = engine.generate(question, docs, strategy="full", max_new_tokens=max_new_tokens)
        target = ref.token_ids or [min(engine.eos_ids)]
        ref_lp = engine.next_token_logprobs(question, docs, target, strategy="full")
        reuse_kl += _kl(ref_lp, engine.next_token_logprobs(question, docs, target, strategy="reuse"))
        for layer in range(n_layers):
            lp = engine.next_token_logprobs(question, docs, target, strategy=SingleLayerProbe(layer),
                                            recompute_ratio=ratio)
            kl[layer] += _kl(ref_lp, lp)
        if progress:
            progress(f"example {i + 1}/{len(examples)}: best layer so far {int(torch.argmin(kl))}")
    kl /= len(examples)
    order = sorted(range(n_layers), key=lambda j: (float(kl[j]), j))
    top = max(1, min(int(top), n_layers))
    return {
        "version": PROFILE_VERSION,
        "model": engine.model_name,
        "fingerprint": engine.namespace.model,
        "n_layers": n_layers,
        "critical_layers": sorted(order[:top]),
        "method": "single-layer question-attention selector; mean KL(full || fused) over the full answer",
        "ratio": ratio,
        "examples": len(examples),
        "max_new_tokens": max_new_tokens,
        "kl_per_layer": [round(float(x), 6) for x in kl],
        "kl_reuse": round(reuse_kl / len(examples), 6),
        "seconds": round(time.perf_counter() - t0, 1),
    }


# -- document anchors (qcfuse's digest) -----------------------------------------------------------------------
class _RowProbe(Strategy):
    def __init__(self, layers) -> None:
        self.layers = tuple(layers)

    def probe_layers(self, n_layers: int):
        return self.layers


class AnchorProfiler:
    """Computes `extras["anchors"]` (int32 sorted local indices) of one document from its stored cache.

    The sampled rows (every `stride`-th token and the last one) are recomputed exactly over the document's own
    cache (after the prefix) up to the deepest critical layer; the attention each token receives from them, summed
    over rows and averaged over the critical layers, ranks the tokens. Anchors = the first `sinks` tokens plus the
    `ratio` share of the document's tokens ranked highest among the rest.

    Args:
        ratio: share of the document's tokens kept besides the sinks (~15%).
        sinks: leading tokens always kept.
        stride: row sampling step (cost ~ 1/stride of the document's prefill, up to the deepest critical layer).
    """

    name = "anchors"

    def __init__(self, ratio: float = 0.15, sinks: int = 4, stride: int = 4) -> None:
        if not 0.0 <= ratio <= 1.0 or sinks < 0 or stride < 1:
            raise ValueError("need 0 <= ratio <= 1, sinks >= 0, stride >= 1")
        self.ratio, self.sinks, self.stride = float(ratio), int(sinks), int(stride)

    def __call__(self, cache, ids: list[int], kv: DocKV) -> dict[str, torch.Tensor]:
        length = kv.length
        n_sinks = min(self.sinks, length)
        k = budget_for(self.ratio, length)
        if n_sinks + k >= length:
            return {"anchors": torch.arange(length, dtype=torch.int32)}
        scores = self.token_scores(cache, ids, kv)
        rest = torch.arange(n_sinks, length)
        top = topk_positions(scores[n_sinks:], rest, k)
        anchors = torch.cat([torch.arange(n_sinks), top])
        return {"anchors": torch.sort(anchors).values.to(torch.int32)}

    def token_scores(self, cache, ids: list[int], kv: DocKV) -> torch.Tensor:
        """[L] attention each document token receives from the sampled rows (mean over critical layers)."""
        cache = getattr(cache, "doc_cache", cache)  # an engine: its DocumentCache
        p, length = len(cache.prompts.prefix_ids), kv.length
        sampled = set(range(0, length, self.stride)) | {length - 1}
        pieces, j = [], 0  # the document after the prefix: sampled rows computed, the runs between them cached
        while j < length:
            if j in sampled:
                pieces.append((ids[j:j + 1], None))
                j += 1
                continue
            e = j
            while e < length and e not in sampled:
                e += 1
            pieces.append((ids[j:e], DocKV(kv.k[:, j:e], kv.v[:, j:e])))
            j = e
        full, segs = cache.after_prefix(pieces)  # [P + L] ids
        layers = critical_layers_for(cache)
        ctx, _ = select_only(cache.runner, full, segs, _RowProbe(layers), 0.0)
        rows = ctx.question.cpu()
        total = torch.zeros(length, dtype=torch.float32)
        for layer in layers:
            att = ctx.question_attention[layer].float().cpu().clone()
            att[torch.arange(rows.numel()), rows] = 0.0  # a sampled row's attention to itself says nothing
            total += att.sum(0)[p:p + length]
        return total / len(layers)


def default_doc_profilers() -> dict:
    """The document profilers a DocumentCache starts with: extras name -> callable(cache, ids, kv) -> extras."""
    return {AnchorProfiler.name: AnchorProfiler()}

"""The strategy contract and registry.

A strategy chooses which cached document tokens are recomputed. It is pure: it reads a `SelectContext`
(tensors the runner computed) and returns sorted token positions. It never touches the store or the runner.

Two moments exist:
- `initial(ctx)`: before layer 0, the document tokens to compute from the first layer on. Query-aware
  strategies ask for a question probe first (`probe_layers`): the runner then runs the question alone over the
  re-positioned cache and hands them its attention at those layers.
- `refine(ctx)`: after projecting layer `ctx.layer` (one of `check_layers`), the subset of the active
  document tokens to keep recomputing from that layer on (CacheBlend's deviation check).
The runner always adds the tokens that must be computed (the question, anything without a cache).
"""
from __future__ import annotations

from abc import ABC
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

from ..validate import check_real

__all__ = ["SelectContext", "Strategy", "register", "make_strategy", "available", "budget_for", "topk_positions",
           "signature", "parse_spec"]


@dataclass
class SelectContext:
    """What a strategy may look at.

    Attributes:
        n_layers: decoder layers.
        ratio: the recompute ratio asked for (fraction of cached document tokens).
        candidates: [C] int64 sorted positions of cached document tokens (the only ones a strategy picks).
        doc_spans: [(start, end)] of each document in the prompt, prompt order.
        question: [Q] int64 positions of the question rows (always recomputed).
        layer: the check layer being refined (None in `initial`).
        active: [A] int64 sorted document positions currently recomputed (set in `refine`).
        fresh_k / cached_k: [A, kv_heads, head_dim] pre-RoPE keys of `active` computed now vs from cache.
        fresh_v / cached_v: the same for values.
        question_attention: {layer: [Q, N] float32} softmax probabilities of the question rows over all keys,
            averaged over heads (from the probe pass; only for `probe_layers`).
        doc_extras: per document (prompt order), the extra tensors stored with its cache (e.g. anchors).
        budget_tokens: the document tokens the ratio applies to (None: the candidates). A document served exactly
            (the first one, right after the cached prefix) is not a candidate but counts here: its share of the
            budget goes to the others.
        exact_spans / exact_extras: those exact documents' spans and stored extras (a probe may still compress
            them, e.g. to their anchors).
        probe_rows: [Q] bool, True at the rows of `question` that hold the question's own tokens (not the question
            template, the chat suffix or document titles); None when the prompt marks none (then every row is the
            question's).
    """

    n_layers: int
    ratio: float
    candidates: Tensor
    doc_spans: list[tuple[int, int]]
    question: Tensor
    layer: int | None = None
    active: Tensor | None = None
    fresh_k: Tensor | None = None
    cached_k: Tensor | None = None
    fresh_v: Tensor | None = None
    cached_v: Tensor | None = None
    question_attention: dict[int, Tensor] = field(default_factory=dict)
    doc_extras: list[dict[str, Tensor]] = field(default_factory=list)
    budget_tokens: int | None = None
    exact_spans: list[tuple[int, int]] = field(default_factory=list)  # exact documents: never candidates
    exact_extras: list[dict[str, Tensor]] = field(default_factory=list)  # their extras (e.g. anchors)
    probe_rows: Tensor | None = None  # [Q] bool: the question's own tokens among `question`

    @property
    def budget(self) -> int:
        """Document tokens to recompute: round(ratio * budget_tokens), at most every candidate."""
        return self.budget_at(self.ratio)

    def budget_at(self, ratio: float) -> int:
        """The budget at another ratio (e.g. a gradual schedule's): round(ratio * budget_tokens) <= candidates."""
        n = int(self.candidates.numel())
        return min(n, budget_for(ratio, n if self.budget_tokens is None else self.budget_tokens))


def signature(strategy: "Strategy") -> tuple | None:
    """(class name, sorted options as reprs): what a CUDA graph of a strategy's prefill is keyed by; None when an
    option cannot be ordered."""
    try:
        return type(strategy).__name__, tuple(sorted((k, repr(v)) for k, v in vars(strategy).items()))
    except TypeError:
        return None


def budget_for(ratio: float, n: int) -> int:
    return max(0, min(n, int(round(ratio * n))))


def topk_positions(scores: Tensor, positions: Tensor, k: int) -> Tensor:
    """The k positions with the highest scores, sorted by position (ties broken by lower position)."""
    if k >= positions.numel():
        return positions.clone()
    if k <= 0:
        return positions[:0]
    idx = torch.topk(scores.float(), k, sorted=False).indices
    return torch.sort(positions[idx]).values


DRIFT_FROM = 0.25  # default first layer of the drift correction, as a share of the depth


class Strategy(ABC):
    """Base class; subclasses set `name` and override what they need.

    Attributes:
        uses_cache: False only for `full`, which ignores every cache.
        ignores_ratio: True for strategies whose selection does not depend on the ratio (`reuse`).
        graph_safe: True when selection depends only on the context's tensors and the prompt layout (no host
            reads of tensor values, no per-document extras), so a CUDA graph of the prefill may replay it.
        layout_free: True when the choice is the top `budget` of `scores(ctx)` (after a probe; only the question
            attention and the candidates are read) or of `refine_scores` (one check layer), or `initial` depends on
            the layout alone and runs on the host: one graph per shape bucket then serves every layout.
    """

    name: ClassVar[str] = ""
    uses_cache: ClassVar[bool] = True
    ignores_ratio: ClassVar[bool] = False
    graph_safe: ClassVar[bool] = False  # its selection is pure tensor work on the context (CUDA-graph replayable)
    layout_free: ClassVar[bool] = False  # its choice is a top-k of `scores`/`refine_scores`, or a host function of
    #   the layout alone: it runs in bucketed graphs whatever the layout (engine/bucketed.py)
    refine_scores = None  # optional (fresh, cached) [T, kv_heads, head_dim] -> [T] scores of its one check layer
    drift: float = 0.0  # the drift correction's weight (make_strategy's `drift` option; 0 = off)
    drift_from: float = DRIFT_FROM  # its first layer, as a share of the depth

    def drift_layer(self, n_layers: int) -> int | None:
        """The first layer of the drift correction (`drift` > 0), or None when it is off."""
        if not self.drift:
            return None
        return min(n_layers - 1, int(round(self.drift_from * n_layers)))

    def probe_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers at which the question probe records attention (empty: no probe)."""
        return ()

    def probe_keys(self, ctx: SelectContext) -> Tensor | None:
        """Positions of cached keys the probed question attends to (None: all of them). The question rows
        are always added. Scores in `question_attention` still cover every key."""
        return None

    def check_layers(self, n_layers: int) -> tuple[int, ...]:
        """Layers after whose projection `refine` runs."""
        return ()

    def initial(self, ctx: SelectContext) -> Tensor:
        """Document positions computed from layer 0 (default: none)."""
        return ctx.candidates[:0]

    def refine(self, ctx: SelectContext) -> Tensor:
        """Subset of `ctx.active` to keep at `ctx.layer` (default: keep all)."""
        return ctx.active

    def describe(self) -> str:
        return self.name


_REGISTRY: dict[str, type[Strategy]] = {}


def register(cls: type[Strategy]) -> type[Strategy]:
    """Class decorator adding a strategy to the registry under `cls.name`."""
    if not cls.name:
        raise ValueError(f"{cls.__name__} has no name")
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"strategy {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    return sorted(_REGISTRY)


def _spec_value(text: str):
    """One option value of a strategy spec: true/false, an int, a float, `a..b` (the ints a to b), `a/b/c` (a
    tuple of numbers), else the text itself."""
    low = text.lower()
    if low in ("true", "false"):
        return low == "true"
    if ".." in text:
        lo, hi = text.split("..", 1)
        return tuple(range(int(lo), int(hi) + 1))
    if "/" in text:
        return tuple(_spec_value(x) for x in text.split("/"))
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_spec(spec: str) -> tuple[str, dict]:
    """A strategy spec `name` or `name:key=value:key=value` (a variant on the command line, e.g.
    `infoflow:layers=16..23:rows=all`) -> (name, options). Raises ValueError on a malformed option."""
    name, *parts = spec.strip().split(":")
    options = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq or not key.strip() or not value.strip():
            raise ValueError(f"strategy spec {spec!r}: option {part!r} is not key=value")
        try:
            options[key.strip()] = _spec_value(value.strip())
        except ValueError:
            raise ValueError(f"strategy spec {spec!r}: bad value in {part!r}") from None
    return name.strip(), options


def probes(spec: str | Strategy) -> bool:
    """Whether strategy `spec` runs a question probe (the pass `guard_at="probe"` reads its gap from). Every
    built-in strategy's answer is the same at any layer count; 24 stands for one."""
    return bool(make_strategy(spec).probe_layers(24))


def make_strategy(name: str | Strategy, **options) -> Strategy:
    """A strategy instance by name or spec (`parse_spec`; options go to its constructor, keywords over the
    spec's), or the instance given.

    `doc_context` (every strategy that reads caches but fusionrag, whose own options say it): "pool", "builtin",
    "similar", "random" or "first" serves the strategy each document's cache computed with three other documents
    before it instead of after the prefix alone (fusionrag's cache variant, engine/corpus.py): "pool" documents the
    engine has seen (no corpus needed), "builtin" a fixed context of three passages shipped with kvfuse, the others
    picked from the engine's corpus (leak-free). The first document, right after the prefix, keeps its exact plain
    cache. Default: none (with the shipped fusion adapter it costs fidelity: docs/quality/doc_context.md).

    Two options every strategy takes (they act in the runner, not in selection): `drift` (in [0, 1]; 0 = off)
    and `drift_from` (in [0, 1), default 0.25): from layer round(drift_from x layers) on, each document row that is
    not recomputed gets `drift` x its document's mean drift added to its cached K and V, where the drift is the
    recomputed rows' fresh minus cached K/V at that layer (kernels/drift.py). Set on the instance as attributes,
    so they are part of its signature."""
    if isinstance(name, Strategy):
        return name
    name, spec_options = parse_spec(name)
    if name not in _REGISTRY:
        raise ValueError(f"unknown strategy {name!r}; available: {', '.join(available())}")
    options = {**spec_options, **options}
    drift = check_real(options.pop("drift", 0.0), f"strategy {name!r}: drift", low=0.0, high=1.0)
    drift_from = check_real(options.pop("drift_from", DRIFT_FROM), f"strategy {name!r}: drift_from", low=0.0,
                            high=1.0)
    if drift_from == 1.0:
        raise ValueError(f"strategy {name!r}: drift_from must be below 1 (a share of the depth), got 1")
    doc_context = options.pop("doc_context", None)
    strategy = _REGISTRY[name](**options)
    if doc_context not in (None, "none"):
        from ..corpus import PICKS

        if doc_context not in PICKS:
            raise ValueError(f"strategy {name!r}: doc_context must be one of {PICKS} or 'none', "
                             f"got {doc_context!r}")
        if getattr(strategy, "cache_variant", None) or not strategy.uses_cache:
            raise ValueError(f"strategy {name!r} takes no doc_context (it reads no cache, or picks its own "
                             f"variant: for fusionrag use pick=)")
        source = make_strategy("fusionrag", pick=doc_context)  # its variant, with fusionrag's default options
        strategy.cache_variant, strategy.variant_options = source.cache_variant, source.variant_options
    if drift > 0.0:
        strategy.drift, strategy.drift_from = drift, drift_from
    return strategy

"""GenerationOptions: how one request is fused, sampled and stopped, in one validated, immutable value.

`FusionEngine.generate` / `stream` / `chat` / `stream_chat` take one (`options=`), and still take the same
settings as keywords (`strategy=`, `max_new_tokens=`, ...; other keywords are strategy options), which override
the fields of `options`. What depends on the model (`max_new_tokens` against the context window, `teacher_ids`
against the vocabulary) is checked by the engine, before any work.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

from .auto import AUTO
from .fusion import DEFAULT_STRATEGY
from .fusion.base import Strategy
from .validate import (check_bool, check_guard_at, check_int, check_real, check_seed, check_stop, check_strategy,
                       check_token_ids)

__all__ = ["GenerationOptions"]


@dataclass(frozen=True)
class GenerationOptions:
    """The settings of one request. Frozen; validated at construction (one ValueError naming the field).

    Attributes:
        strategy: the fusion strategy: a registered name ("infoflow", "cacheblend", "reuse", "full", ...;
            `kvfuse.engine.fusion.available()`), a variant spec "name:key=value:..." (e.g.
            "infoflow:rows=all"; `strategy_options` win over its values), or a Strategy instance (used as given,
            `strategy_options` ignored).
            Default `kvfuse.engine.fusion.DEFAULT_STRATEGY`.
        recompute_ratio: fraction of the cached document tokens the strategy recomputes, in [0, 1] (ignored by
            "full", which recomputes everything, and "reuse", which recomputes none).
        max_new_tokens: answer tokens to generate at most, >= 1 (the engine also requires prompt + answer to fit
            the model's context window).
        temperature: sampling temperature, >= 0; 0 is greedy decoding (deterministic argmax).
        top_p: nucleus sampling mass, in (0, 1]; 1 samples from the whole distribution. Only used when
            temperature > 0.
        seed: seeds the sampler (an int in [-2**63, 2**64)); None draws a fresh seed per request. Only used when
            temperature > 0.
        stop: stop strings: generation ends before the first occurrence of any of them (not included in the
            text; finish_reason "stop"). Given as None, one string or a list; stored as a tuple.
        teacher_ids: token ids to score teacher-forced from the request's prefill (`generate` / `stream` only):
            `result.extra["teacher_logprobs"]` is [T, vocab] float32, row t = log p(. | prompt, ids[:t]).
            Given as any sequence or 1-D integer tensor; stored as a tuple of ints (checked against the model's
            vocabulary by the engine). None: no scoring.
        return_logprobs: when True, `result.extra["logprobs"]` holds [max(1, generated), vocab] float32
            log-probabilities of the answer's positions, re-scored after decoding from the same prefill.
        strategy_options: keyword arguments of the strategy's constructor (e.g. `{"gradual": True}` for
            cacheblend, `{"reorder": True}` for infoflow); a read-only mapping.
        target_fidelity: with strategy "auto" (engine/auto.py): the fastest point of the model's measured front
            whose fidelity to full prefill is >= this, in (0, 1]; full prefill when none is.
        ttft_budget_s: with strategy "auto": the most faithful point whose predicted TTFT is <= this many seconds
            (> 0); the fastest when none fits. At most one of the two; with neither, "auto" is the front's default
            point. "auto" ignores `recompute_ratio` (the point sets it) and takes no strategy options.
        guard_margin: the guard, in nats (>= 0; 0 turns it off; None: the engine's `EngineConfig.guard_margin`,
            itself None by default): when a token of the answer is a near-tie on the
            fused path (its two most likely tokens' log-probabilities less than this apart), the request switches
            to full prefill there: the prompt is prefilled in full, the answer so far re-read, and every token from
            that one on is full prefill's (`result.strategy == "full"`, `result.extra["guard"]` says where and
            from what). Almost every fused answer that differs from full prefill's starts at such a token, mostly
            the first (docs/quality/guard.md); a guarded request costs one full prefill more when it trips.
        guard_tokens: how many of the answer's first tokens the guard checks (>= 1; None: every token). 1 checks
            the first token only: a hand-over then costs TTFT and never stalls a stream mid-answer.
        guard_at: where the guard reads its gap (None: the engine's `EngineConfig.guard_at`, "answer" by default).
            "answer": the fused answer's tokens, as above. "probe": before the fused prefill, the first-token gap of
            the question probe a query-aware strategy runs anyway (infoflow, prophetkv, qcfuse, coinrag): the prompt
            over the cached documents with nothing recomputed. Below the margin full prefill answers and the fused
            prefill is never run, so a hand-over costs the probe and a full prefill instead of a fused prefill and a
            full one (docs/quality/guard.md); the answer's tokens are not checked. Not with `guard_tokens`.
    """

    strategy: str | Strategy = DEFAULT_STRATEGY
    recompute_ratio: float = 0.15
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    teacher_ids: tuple[int, ...] | None = None
    return_logprobs: bool = False
    strategy_options: Mapping[str, Any] = field(default_factory=dict)
    target_fidelity: float | None = None
    ttft_budget_s: float | None = None
    guard_margin: float | None = None
    guard_tokens: int | None = None
    guard_at: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.strategy_options, Mapping):
            raise ValueError(f"strategy_options must be a mapping of keyword arguments, got "
                             f"{type(self.strategy_options).__name__}")
        opts = dict(self.strategy_options)
        bad = [k for k in opts if not isinstance(k, str) or not k.isidentifier()]
        if bad:
            raise ValueError(f"strategy_options keys must be keyword names, got {bad[0]!r}")
        auto = self.strategy == AUTO
        if auto and opts:
            raise ValueError(f"strategy 'auto' takes no strategy options, got {sorted(opts)}")
        if not auto:
            check_strategy(self.strategy, opts)  # a wrong type, an unknown name or bad options
        for name in ("target_fidelity", "ttft_budget_s"):
            if getattr(self, name) is not None and not auto:
                raise ValueError(f"{name} is an option of strategy 'auto' (this request's strategy is "
                                 f"{self.strategy_name!r})")
        if self.target_fidelity is not None and self.ttft_budget_s is not None:
            raise ValueError("give target_fidelity or ttft_budget_s, not both")
        if self.target_fidelity is not None:
            object.__setattr__(self, "target_fidelity", check_real(self.target_fidelity, "target_fidelity",
                                                                   low=0.0, high=1.0, low_open=True))
        if self.ttft_budget_s is not None:
            object.__setattr__(self, "ttft_budget_s", check_real(self.ttft_budget_s, "ttft_budget_s", low=0.0,
                                                                 low_open=True))
        set_ = object.__setattr__
        if self.guard_margin is not None:
            set_(self, "guard_margin", check_real(self.guard_margin, "guard_margin", low=0.0))
        if self.guard_tokens is not None:
            set_(self, "guard_tokens", check_int(self.guard_tokens, "guard_tokens", minimum=1))
        check_guard_at(self.guard_at, self.guard_tokens)
        set_(self, "strategy_options", MappingProxyType(opts))
        set_(self, "recompute_ratio", check_real(self.recompute_ratio, "recompute_ratio", low=0.0, high=1.0))
        set_(self, "max_new_tokens", check_int(self.max_new_tokens, "max_new_tokens", minimum=1))
        set_(self, "temperature", check_real(self.temperature, "temperature", low=0.0))
        set_(self, "top_p", check_real(self.top_p, "top_p", low=0.0, high=1.0, low_open=True))
        set_(self, "seed", check_seed(self.seed))
        set_(self, "stop", tuple(check_stop(self.stop)))
        if self.teacher_ids is not None:
            set_(self, "teacher_ids", tuple(check_token_ids(self.teacher_ids, "teacher_ids", None)))
        check_bool(self.return_logprobs, "return_logprobs")

    # -- building ----------------------------------------------------------------------------------------------
    def replace(self, **changes: Any) -> GenerationOptions:
        """A copy with some fields changed (`dataclasses.replace`: field names only), validated again."""
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> GenerationOptions:
        """Options from the engine methods' keywords: field names set fields, any other keyword is a strategy
        option (`from_kwargs(strategy="cacheblend", gradual=True)`); `strategy_options=` may also be given as a
        mapping, the loose keywords added to it."""
        return cls()._with_kwargs(kwargs)

    def _with_kwargs(self, kwargs: Mapping[str, Any]) -> GenerationOptions:
        """These options overridden by engine-method keywords (see `from_kwargs`): fields named are replaced,
        other keywords are added to (or override) the strategy options."""
        if not kwargs:
            return self
        names = _FIELDS
        changes = {k: v for k, v in kwargs.items() if k in names}
        loose = {k: v for k, v in kwargs.items() if k not in names}
        if loose:
            base = changes.get("strategy_options", self.strategy_options)
            if not isinstance(base, Mapping):
                raise ValueError(f"strategy_options must be a mapping of keyword arguments, got "
                                 f"{type(base).__name__}")
            changes["strategy_options"] = {**base, **loose}
        return self.replace(**changes)

    # -- reading -----------------------------------------------------------------------------------------------
    @property
    def strategy_name(self) -> str:
        """The strategy's registered name."""
        return self.strategy if isinstance(self.strategy, str) else self.strategy.name

    def make_strategy(self) -> Strategy | None:
        """A strategy for one request: a new instance for a name (with `strategy_options`), else the instance;
        None for "auto" (the engine picks per request)."""
        if self.strategy == AUTO:
            return None
        return check_strategy(self.strategy, dict(self.strategy_options))

    def as_kwargs(self) -> dict[str, Any]:
        """The engine-method keywords these options stand for (strategy options as loose keywords);
        `GenerationOptions.from_kwargs(**o.as_kwargs()) == o`."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "strategy_options"}
        out.update(self.strategy_options)
        return out

    def __hash__(self) -> int:  # the read-only mapping is not hashable itself; its items are (when their values are)
        return hash(tuple(getattr(self, f.name) for f in fields(self) if f.name != "strategy_options")
                    + (tuple(sorted(self.strategy_options.items())),))

    def __reduce__(self):  # the read-only mapping does not pickle or deep-copy by itself
        return _restore, ({f.name: getattr(self, f.name) for f in fields(self) if f.name != "strategy_options"},
                          dict(self.strategy_options))


_FIELDS = frozenset(f.name for f in fields(GenerationOptions))


def _restore(values: dict[str, Any], strategy_options: dict[str, Any]) -> GenerationOptions:
    return GenerationOptions(**values, strategy_options=strategy_options)

"""Runs strategies over examples against the full-prefill reference, one resumable record per run.

For every example the runner
1. hands the passages to `engine.precompute` (the offline step: caches, plus the anchors or cache variants of
   the strategies that read them) and counts cache hits and misses;
2. runs `full` (the reference; its answer is stored with its token ids, and its per-step log-probabilities
   come from the same generation);
3. runs each pending (strategy, ratio) and scores it: task metric against the gold answers, fidelity (F1
   against the full answer) and KL(full || strategy) of the next-token distributions, teacher forced over the
   full answer's tokens from the same prefill as the strategy's own answer (one prefill per run).

Every finished run is appended at once to `<out>/records.jsonl`, keyed by
(example id, strategy, ratio, model, max_new_tokens); a rerun with the same folder skips what is there.
"""
from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

# runs with GenerationOptions.guard_margin are labelled "<strategy>+guard0.5" ("+guard0.5/1": guard_tokens 1); one
# tag for both, since fronts read the labels back
from kvfuse.engine.auto import GUARD_TAG, PROBE_GUARD_TAG

from .data import Example
from .metrics import fidelity, mean_kl, metric_name, task_score

__all__ = ["Config", "RecordStore", "RunStats", "EvalRunner", "build_configs", "record_key", "load_engine",
           "RATIO_FREE", "REFERENCE"]

REFERENCE = "full"
# Strategies whose result does not depend on the ratio: run once, with this ratio in the record.
RATIO_FREE = {"full": 1.0, "reuse": 0.0}
RECORDS_FILE = "records.jsonl"
WARMUP_DOC = ("kvfuse-eval-warmup", "This short document only warms the engine up before timing.")




@dataclass(frozen=True)
class Config:
    """One (strategy, recompute ratio[, guard margin]) setting."""

    strategy: str
    ratio: float
    guard: float | None = None
    guard_tokens: int | None = None
    guard_at: str = "answer"  # GenerationOptions.guard_at of the guard

    @property
    def guard_tag(self) -> str:
        if self.guard is None:
            return ""
        if self.guard_at == "probe":
            return f"{PROBE_GUARD_TAG}{self.guard:g}"
        return f"{GUARD_TAG}{self.guard:g}" + ("" if self.guard_tokens is None else f"/{self.guard_tokens}")

    @property
    def label(self) -> str:
        name = self.strategy if self.strategy in RATIO_FREE else f"{self.strategy}@{self.ratio:g}"
        return name + self.guard_tag


def _registered() -> list[str] | None:
    """Names in the engine's strategy registry, or None when the registry cannot be imported."""
    try:
        from kvfuse.engine.fusion import available
    except Exception:  # the engine reports its own import problem when it is loaded
        return None
    return list(available())


def _ratio_free(strategy: str) -> float | None:
    """The fixed ratio of a strategy that ignores it, else None (asks the registry when it is importable)."""
    if strategy in RATIO_FREE:
        return RATIO_FREE[strategy]
    try:
        from kvfuse.engine.fusion import make_strategy
        inst = make_strategy(strategy)
    except Exception:  # registry not importable or unknown name: the engine reports it on first use
        return None
    if not getattr(inst, "uses_cache", True):
        return 1.0
    if getattr(inst, "ignores_ratio", False):
        return 0.0
    return None


def _offline_strategies(configs: Sequence[Config]) -> list[str]:
    """Strategies of `configs` with offline per-document work (`needs_extras`, a `cache_variant`, or selective
    indexes)."""
    out: list[str] = []
    for c in configs:
        if c.strategy in out or c.strategy in RATIO_FREE:
            continue
        try:
            from kvfuse.engine.fusion import make_strategy
            inst = make_strategy(c.strategy)
        except Exception:  # registry not importable or unknown name: the engine reports it on first use
            continue
        if (getattr(inst, "needs_extras", ()) or getattr(inst, "cache_variant", None)
                or getattr(inst, "sparse_index", False)):  # sift's indexes are built offline like caches
            out.append(c.strategy)
    return out


def build_configs(strategies: Sequence[str], ratios: Sequence[float], guards: Sequence[float] = (),
                  guard_tokens: int | None = None, guard_at: str = "answer") -> list[Config]:
    """`full` first (always: it is the reference), then every strategy at every ratio, each also with every guard
    margin of `guards` (GenerationOptions.guard_margin, checking the first `guard_tokens` answer tokens; full is
    never guarded). With `guard_at="probe"` the guards read the question probe (GenerationOptions.guard_at), and
    only strategies that run one (infoflow, prophetkv, qcfuse, coinrag) get guarded variants.

    Strategies that ignore the ratio (`full`, `reuse`) appear once, with ratio 1 / 0.

    Raises:
        ValueError: for an empty strategy name, no ratios, or a ratio outside (0, 1].
    """
    if not ratios:
        raise ValueError("--ratios: give at least one ratio")
    for g in guards:
        if not (isinstance(g, (int, float)) and math.isfinite(g) and g > 0):
            raise ValueError(f"--guard: {g!r} is not a margin > 0 (nats)")
    for r in ratios:
        if not (isinstance(r, (int, float)) and math.isfinite(r) and 0.0 < r <= 1.0):
            raise ValueError(f"--ratios: {r!r} is not in (0, 1]")
    known = _registered()
    out: list[Config] = [Config(REFERENCE, RATIO_FREE[REFERENCE])]
    for s in strategies:
        s = s.strip()
        if not s:
            raise ValueError("--strategies: empty strategy name")
        if known is not None:
            from kvfuse.engine.fusion import make_strategy
            from kvfuse.engine.fusion.base import parse_spec

            try:
                name = parse_spec(s)[0]
                if name in known:
                    make_strategy(s)
            except (TypeError, ValueError) as e:
                raise ValueError(f"--strategies: {s!r}: {e}") from None
            if name not in known:
                raise ValueError(f"--strategies: unknown strategy {s!r}; available: {', '.join(known)} (a variant: "
                                 f"name:key=value, e.g. infoflow:rows=all)")
        fixed = _ratio_free(s)
        guarded = s != REFERENCE and (guard_at != "probe" or _probes(s))
        for r in ([fixed] if fixed is not None else ratios):
            for g in ([None] + [float(g) for g in guards]) if guarded else [None]:
                c = (Config(s, round(float(r), 4), g, None if g is None else guard_tokens) if guard_at != "probe"
                     else Config(s, round(float(r), 4), g, None, "answer" if g is None else "probe"))
                if c not in out:
                    out.append(c)
    return out


def _probes(spec: str) -> bool:
    """Whether strategy `spec` runs a question probe (what guard_at="probe" reads)."""
    try:
        from kvfuse.engine.fusion import probes

        return probes(spec)
    except (ImportError, TypeError, ValueError):
        return False


def record_key(example_id: str, strategy: str, ratio: float, model: str, max_new_tokens: int,
               prompt: str = "qa", dtype: str | None = None) -> tuple:
    """The resume key of one run. `dtype` is the requested engine dtype (None: the engine's default), so an fp32
    rerun into the same folder runs again instead of being served the bf16 records."""
    dt = "" if dtype is None else str(dtype).lower().removeprefix("torch.")
    return (str(example_id), str(strategy), f"{float(ratio):.4f}", str(model), int(max_new_tokens), str(prompt), dt)


def _key_of(rec: dict[str, Any]) -> tuple:
    return record_key(rec["example_id"], rec["strategy"], rec["ratio"], rec["model"], rec["max_new_tokens"],
                      rec.get("prompt", "qa"), rec.get("dtype"))


class RecordStore:
    """The append-only `records.jsonl` of an output folder.

    Lines that do not parse (a run killed mid-write) are skipped and counted in `bad_lines`.
    """

    def __init__(self, out_dir: str | Path) -> None:
        self.out_dir = Path(out_dir)
        self.path = self.out_dir / RECORDS_FILE
        self.records: dict[tuple, dict[str, Any]] = {}
        self.bad_lines = 0
        if self.path.exists():
            with open(self.path, encoding="utf-8") as fh:
                for line in fh:
                    if not line.strip():
                        continue
                    try:
                        rec = json.loads(line)
                        key = _key_of(rec)
                    except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                        self.bad_lines += 1
                        continue
                    self.records[key] = rec

    def __contains__(self, key: tuple) -> bool:
        return key in self.records

    def get(self, key: tuple) -> dict[str, Any] | None:
        return self.records.get(key)

    def append(self, rec: dict[str, Any]) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        line = json.dumps(rec, ensure_ascii=False, allow_nan=True)
        with open(self.path, "a+b") as fh:
            fh.seek(0, os.SEEK_END)
            if fh.tell() > 0:  # a killed run may have left a partial line without its newline
                fh.seek(-1, os.SEEK_END)
                if fh.read(1) != b"\n":
                    fh.write(b"\n")
            fh.write(line.encode("utf-8") + b"\n")
            fh.flush()
            os.fsync(fh.fileno())
        self.records[_key_of(rec)] = rec

    def all(self) -> list[dict[str, Any]]:
        return list(self.records.values())


@dataclass
class RunStats:
    """What one `EvalRunner.run` call did."""

    total: int = 0  # examples x configs asked for
    executed: int = 0  # runs computed now
    skipped: int = 0  # runs found in records.jsonl
    examples: int = 0
    passage_slots: int = 0  # passages handed to precompute (with repeats across examples)
    distinct_passages: int = 0  # distinct passage ids among them
    precompute_misses: int = 0  # passages the engine computed
    precompute_hits: int = 0  # passages served from its cache
    precompute_tokens: int = 0
    precompute_s: float = 0.0
    selfcheck: list[dict[str, Any]] = field(default_factory=list)
    too_long: list[str] = field(default_factory=list)  # examples skipped: over the context window
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        lines = [f"runs: {self.executed} computed, {self.skipped} already in records ({self.total} asked, "
                 f"{self.examples} examples)"]
        if self.passage_slots:
            lines.append(f"passages: {self.passage_slots} handed to the engine, {self.distinct_passages} distinct; "
                         f"precompute computed {self.precompute_misses}, served {self.precompute_hits} from cache "
                         f"({self.precompute_tokens} tokens, {self.precompute_s:.1f} s)")
        if self.too_long:
            lines.append(f"skipped {len(self.too_long)} example(s) over the model's context window")
        for sc in self.selfcheck:
            lines.append(f"self-check {sc['example_id']}: KL(full || full) = {sc['kl_full_full']:.2e}, "
                         f"greedy agreement of the teacher-forced full pass = {sc['greedy_agreement']:.3f} "
                         f"over {sc['tokens']} tokens")
        return "\n".join(lines)


def load_engine(model: str, device: str | None = None, dtype: str | None = None, prompt: str = "qa",
                adapter: Any = None, links: Any = "auto") -> Any:
    """`FusionEngine.from_pretrained(model, device=..., dtype=..., prompt=PROMPT_PRESETS[prompt], adapter=...,
    links=...)` (device and dtype only when given)."""
    try:
        from kvfuse.engine.api import FusionEngine
        from kvfuse.engine.prompt import PROMPT_PRESETS
    except ImportError as e:
        raise ValueError(f"cannot import the engine (kvfuse.engine.api): {e}") from None
    if prompt not in PROMPT_PRESETS:
        raise ValueError(f"unknown prompt {prompt!r}; available: {', '.join(PROMPT_PRESETS)}")
    # every strategy is measured as itself: a request never switches to full prefill for documents without a
    # cache (the harness precomputes them anyway; an eviction must not turn a strategy's row into full's answers)
    kwargs: dict[str, Any] = {"prompt": PROMPT_PRESETS[prompt], "adapter": adapter, "links": links,
                              "cold_documents": "compute"}
    if device:
        kwargs["device"] = device
    if dtype:
        kwargs["dtype"] = dtype
    return FusionEngine.from_pretrained(model, **kwargs)


def attach_pool(engine: Any, examples: Sequence[Example], exclude: Sequence[Example] = ()) -> Any:
    """Fills `engine`'s document pool (the context `pick="pool"` draws from; engine/corpus.py DocumentPool) with
    passages of `examples`, the same datasets' examples outside the evaluated selection, taken from each dataset in
    turn, so the pool is full (frozen) before any evaluated request: what a deployment has (its own other
    documents); no passage of an `exclude` example (the evaluated ones) goes in, even one shared with another
    question."""
    from kvfuse.engine.types import as_documents

    pool = engine.doc_cache.pool
    banned = {text for ex in exclude for _, text in ex.docs}
    by_set: dict[str, list] = {}
    for ex in examples:
        by_set.setdefault(ex.dataset, []).extend(d for d in ex.docs if d[1] not in banned)
    queues = [iter(as_documents(docs)) for docs in by_set.values()]
    while queues and not pool.full:
        for q in list(queues):
            d = next(q, None)
            if d is None:
                queues.remove(q)
            else:
                pool.add([d])
    return engine


def attach_corpus(engine: Any, examples: Sequence[Example], embed: Callable | None = None) -> Any:
    """Gives `engine` the corpus that neighbour-based cache variants (fusionrag) search: every passage of
    `examples`, each example's passages registered as one group (retrieved together), so no passage is ever
    prefilled with a passage of a question it was retrieved for. `embed` defaults to all-MiniLM-L6-v2."""
    from kvfuse.engine.corpus import Corpus

    corpus = Corpus(embed)
    for ex in examples:
        corpus.add(ex.docs, group=ex.id)
    engine.corpus = corpus
    return engine


def _finite(x: Any) -> float | None:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return None
    return x if math.isfinite(x) else None


@functools.lru_cache(maxsize=None)
def _reads_cache(spec: str) -> bool:
    """Whether the strategy `spec` names reads document caches (so an adapter acts on its runs)."""
    from kvfuse.engine.fusion import make_strategy

    return make_strategy(spec).uses_cache


def _links_apply(spec: str) -> bool:
    """Whether a request of the strategy `spec` names is laid out with the engine's link rows (engine/links.py)."""
    from kvfuse.engine.fusion import make_strategy
    from kvfuse.engine.links import applies_to

    return applies_to(make_strategy(spec))


class EvalRunner:
    """Runs configs over examples with one engine; resumable through `RecordStore`.

    Args:
        engine_factory: builds the engine; called once, only when some run is pending.
        out_dir: results folder (records.jsonl lives there).
        model: the model name as asked for (part of the resume key).
        max_new_tokens: generation budget (part of the resume key).
        seed: passed to `generate` (decoding is greedy).
        selfcheck_examples: on this many examples, the reference log-probs are computed twice and checked:
            KL(full || full) must be ~0, and their argmax should reproduce the greedy answer.
        warmup: one short throw-away generation per strategy before timing anything.
        progress: show a tqdm bar.
        extra: fields copied into every record (device, dtype, ...).
        prompt: name of the engine's prompt preset (recorded; part of the resume key).
    """

    def __init__(self, engine_factory: Callable[[], Any], out_dir: str | Path, model: str,
                 max_new_tokens: int = 32, seed: int = 0, selfcheck_examples: int = 2, warmup: bool = True,
                 progress: bool = True, extra: dict[str, Any] | None = None, prompt: str = "qa",
                 adapter_tag: str = "", links_tag: str = "", adapter_digest: str = "",
                 links_digest: str = "") -> None:
        if max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
        self.engine_factory = engine_factory
        self.out_dir = Path(out_dir)
        self.model = model
        self.max_new_tokens = int(max_new_tokens)
        self.seed = seed
        self.prompt = prompt
        self.selfcheck_examples = selfcheck_examples
        self.warmup = warmup
        self.progress = progress
        self.extra = dict(extra or {})
        self.adapter_tag = adapter_tag  # "+adapter" when the engine computes documents with a fusion adapter
        self.links_tag = links_tag  # "+links" when the engine lays fused prompts out with link rows
        # the files behind those tags: recorded with every run they apply to, so one folder never mixes the runs of
        # two adapters (or two sets of link rows) under one label (`check_variants`)
        self.adapter_digest, self.links_digest = adapter_digest, links_digest
        self.store = RecordStore(self.out_dir)
        self.engine: Any = None
        self._seen_passages: set[str] = set()

    # ------------------------------------------------------------------ helpers
    def label(self, cfg: Config) -> str:
        """The strategy as recorded: with the adapter tag, except for strategies that read no cache (`full`, sift:
        the base model whatever the adapter)."""
        files = self.variant(cfg)
        return (cfg.strategy + (self.adapter_tag if "adapter_digest" in files else "")
                + (self.links_tag if "links_digest" in files else "") + cfg.guard_tag)

    def variant(self, cfg: Config) -> dict[str, str]:
        """The digests of the adapter / link rows a run of `cfg` is made with, as recorded: only where they act (the
        label carries the same tags, `label`)."""
        out: dict[str, str] = {}
        if cfg.strategy == REFERENCE:
            return out
        if self.adapter_tag and _reads_cache(cfg.strategy):
            out["adapter_digest"] = self.adapter_digest
        if self.links_tag and _links_apply(cfg.strategy):
            out["links_digest"] = self.links_digest
        return out

    def check_variants(self, configs: Sequence[Config]) -> None:
        """A ValueError, before any work, if the folder already holds runs of one of these labels (same model)
        made with another adapter or other link rows: resuming would take them as done and the report would mix
        them. Records written before digests were recorded carry none and are not checked."""
        want = {self.label(c): self.variant(c) for c in configs}
        for rec in self.store.records.values():
            fields = want.get(rec.get("strategy"))
            if not fields or rec.get("model") != self.model:
                continue
            for name, digest in fields.items():
                got = rec.get(name)
                if got is not None and got != digest:
                    what = "an adapter" if name == "adapter_digest" else "link rows"
                    raise ValueError(f"{self.out_dir} already holds {rec['strategy']!r} runs made with {what} of "
                                     f"digest {got}, not this run's {digest or '(none)'}: use another --out")

    def key(self, example: Example, cfg: Config) -> tuple:
        return record_key(example.id, self.label(cfg), cfg.ratio, self.model, self.max_new_tokens, self.prompt,
                          self.extra.get("dtype"))

    def pending(self, examples: Iterable[Example], configs: Sequence[Config]) -> int:
        return sum(self.key(ex, c) not in self.store for ex in examples for c in configs)

    def _ensure_engine(self) -> Any:
        if self.engine is None:
            print(f"loading {self.model} ...", file=sys.stderr, flush=True)
            t0 = time.perf_counter()
            self.engine = self.engine_factory()
            print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
        return self.engine

    def _warm_up(self, configs: Sequence[Config]) -> None:
        done: set[str] = set()
        for c in configs:
            if c.strategy in done:
                continue
            done.add(c.strategy)
            try:
                self.engine.generate("Say OK.", [WARMUP_DOC], strategy=c.strategy, recompute_ratio=c.ratio,
                                     max_new_tokens=2, temperature=0.0)
            except Exception as e:  # the real call reports the error with its context
                print(f"warm-up of {c.label} failed: {e}", file=sys.stderr)

    def _generate(self, ex: Example, cfg: Config, **scoring: Any):
        """One generation; `scoring` asks the engine for log-probs from the same prefill (`return_logprobs` for
        the reference's own answer, `teacher_ids` for the reference answer teacher-forced)."""
        try:
            if cfg.guard is not None:
                scoring["guard_margin"] = cfg.guard
                scoring["guard_tokens"] = cfg.guard_tokens
                scoring["guard_at"] = cfg.guard_at
            return self.engine.generate(ex.question, ex.docs, strategy=cfg.strategy, recompute_ratio=cfg.ratio,
                                        max_new_tokens=self.max_new_tokens, temperature=0.0, seed=self.seed,
                                        **scoring)
        except ValueError as e:
            raise ValueError(f"{cfg.label} on {ex.id}: {e}") from None

    def _scored(self, ex: Example, cfg: Config, result: Any, key: str, target_ids: list[int]):
        """The [T, V] log-probs the engine returned under `result.extra[key]`, or (an engine without that) a
        separate teacher-forced pass."""
        lp = (getattr(result, "extra", None) or {}).get(key)
        if lp is not None and lp.dim() == 2 and lp.shape[0] == len(target_ids):
            return lp
        return self._logprobs(ex, cfg, target_ids)

    def _logprobs(self, ex: Example, cfg: Config, target_ids: list[int]):
        try:
            lp = self.engine.next_token_logprobs(ex.question, ex.docs, target_ids, strategy=cfg.strategy,
                                                 recompute_ratio=cfg.ratio)
        except ValueError as e:
            raise ValueError(f"{cfg.label} on {ex.id} (next_token_logprobs): {e}") from None
        if lp.dim() != 2 or lp.shape[0] != len(target_ids):
            raise RuntimeError(f"engine.next_token_logprobs returned shape {tuple(lp.shape)} for "
                               f"{len(target_ids)} target tokens ({cfg.label} on {ex.id}); expected [T, V]")
        return lp

    def _record(self, ex: Example, cfg: Config, result: Any, answer_ref: str | None) -> dict[str, Any]:
        answer = result.text
        n_docs_tokens = getattr(result, "doc_tokens", 0) or 0
        recomputed = getattr(result, "recomputed_tokens", 0) or 0
        frac = getattr(result, "recompute_fraction", None)
        if frac is None:
            frac = recomputed / n_docs_tokens if n_docs_tokens else 0.0
        rec: dict[str, Any] = {
            "example_id": ex.id,
            "dataset": ex.dataset,
            "strategy": self.label(cfg),
            "ratio": cfg.ratio,
            "model": self.model,
            "max_new_tokens": self.max_new_tokens,
            "prompt": self.prompt,
            "engine_model": getattr(self.engine, "model_name", None),
            "seed": self.seed,
            "metric": metric_name(ex.dataset),
            "answer": answer,
            "token_ids": [int(t) for t in result.token_ids],
            "gold": list(ex.answers),
            "score": task_score(ex.dataset, answer, ex.answers),
            "fidelity": fidelity(answer, answer if answer_ref is None else answer_ref),
            "kl": None,
            "kl_tokens": 0,
            "ttft_s": _finite(getattr(result, "ttft_s", None)),
            "prefill_s": _finite(getattr(result, "prefill_s", None)),
            "decode_s": _finite(getattr(result, "decode_s", None)),
            "selection_s": _finite(getattr(result, "selection_s", None)),
            "miss_prefill_s": _finite(getattr(result, "miss_prefill_s", None)),
            "prompt_tokens": getattr(result, "prompt_tokens", None),
            "doc_tokens": n_docs_tokens,
            "recomputed_tokens": recomputed,
            "recompute_fraction": float(frac),
            "cache_hits": getattr(result, "cache_hits", None),
            "cache_misses": getattr(result, "cache_misses", None),
            "finish_reason": getattr(result, "finish_reason", None),
            "n_passages": len(ex.passages),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
        }
        if cfg.guard is not None:  # where the guard handed the answer to full prefill (None: it never did)
            g = (getattr(result, "extra", None) or {}).get("guard") or {}
            rec["guard_margin"] = cfg.guard
            rec["guard_at"] = cfg.guard_at
            rec["guard_escalated_at"] = None if g.get("skipped") else g.get("escalated_at")
        sparse = (getattr(result, "extra", None) or {}).get("sift")
        if isinstance(sparse, dict) and "density" in sparse:  # sift: the share of causal block pairs attended
            rec["sift_density"] = _finite(sparse["density"])
        rec.update(self.variant(cfg))
        rec.update(self.extra)
        return rec

    # ------------------------------------------------------------------ main loop
    def run(self, examples: Sequence[Example], configs: Sequence[Config]) -> RunStats:
        """Runs every pending (example, config); returns what was done. Records land in `self.store`."""
        if not configs or configs[0].strategy != REFERENCE:
            raise ValueError("configs must start with the full reference (use build_configs)")
        t_start = time.perf_counter()
        stats = RunStats(total=len(examples) * len(configs), examples=len(examples))
        todo = [(ex, [c for c in configs if self.key(ex, c) not in self.store]) for ex in examples]
        stats.skipped = stats.total - sum(len(p) for _, p in todo)
        if stats.skipped == stats.total:
            stats.seconds = time.perf_counter() - t_start
            return stats

        self._ensure_engine()
        if self.warmup:
            self._warm_up(configs)
        from tqdm.auto import tqdm

        offline = _offline_strategies(configs)
        bar = tqdm(total=stats.total, initial=stats.skipped, unit="run", desc="eval", file=sys.stderr,
                   disable=not self.progress, dynamic_ncols=True)
        selfchecks_left = self.selfcheck_examples
        try:
            for ex, pend in todo:
                if not pend:
                    continue
                if self._too_long(ex):
                    stats.too_long.append(ex.id)
                    bar.update(len(pend))
                    continue
                self._precompute(ex, stats, offline)
                ref_cfg = configs[0]
                ref_key = self.key(ex, ref_cfg)
                ref_rec = self.store.get(ref_key)
                new_ref: dict[str, Any] | None = None
                ref_lp = None
                if ref_rec is None:
                    bar.set_postfix_str(f"{ex.id[:24]} {ref_cfg.label}", refresh=False)
                    ref_result = self._generate(ex, ref_cfg, return_logprobs=True)
                    new_ref = self._record(ex, ref_cfg, ref_result, None)
                    new_ref["kl"], new_ref["kl_tokens"] = 0.0, len(new_ref["token_ids"])
                    ref_rec = new_ref
                    if new_ref["token_ids"]:  # greedy: the step log-probs are the teacher-forced ones
                        ref_lp = self._scored(ex, ref_cfg, ref_result, "logprobs", new_ref["token_ids"])
                target_ids = list(ref_rec["token_ids"])
                others = [c for c in pend if c.strategy != REFERENCE]
                do_check = new_ref is not None and selfchecks_left > 0 and len(target_ids) > 0
                if ref_lp is None and target_ids and others:  # resumed: the reference was read back
                    ref_lp = self._logprobs(ex, ref_cfg, target_ids)
                if do_check:  # a separate teacher-forced pass must agree with the generation's own log-probs
                    selfchecks_left -= 1
                    again = self._logprobs(ex, ref_cfg, target_ids)
                    kl_ff = mean_kl(ref_lp, again)
                    agree = float((ref_lp.argmax(dim=-1).cpu() == _as_long(target_ids)).float().mean())
                    stats.selfcheck.append({"example_id": ex.id, "kl_full_full": kl_ff, "greedy_agreement": agree,
                                            "tokens": len(target_ids)})
                    new_ref.update(kl=kl_ff, kl_selfcheck=True, greedy_agreement=agree)
                if new_ref is not None:
                    self.store.append(new_ref)
                    stats.executed += 1
                    bar.update(1)
                for cfg in others:
                    bar.set_postfix_str(f"{ex.id[:24]} {cfg.label}", refresh=False)
                    scoring = {"teacher_ids": target_ids} if ref_lp is not None else {}
                    result = self._generate(ex, cfg, **scoring)
                    rec = self._record(ex, cfg, result, ref_rec["answer"])
                    if ref_lp is not None:
                        lp = self._scored(ex, cfg, result, "teacher_logprobs", target_ids)
                        rec["kl"] = mean_kl(ref_lp, lp)
                        rec["kl_tokens"] = len(target_ids)
                    self.store.append(rec)
                    stats.executed += 1
                    bar.update(1)
        finally:
            bar.close()
            stats.seconds = time.perf_counter() - t_start
        return stats

    def _too_long(self, ex: Example) -> bool:
        """True when prompt + answer budget exceeds the model's context window (the example is skipped)."""
        window = getattr(self.engine, "context_window", None)
        layout = getattr(self.engine, "layout", None)
        if not window or layout is None:
            return False
        n = int(getattr(layout(ex.question, ex.docs), "n"))
        if n + self.max_new_tokens <= window:
            return False
        print(f"skipping {ex.id}: {n} prompt tokens + {self.max_new_tokens} new tokens exceed the context window "
              f"of {window}", file=sys.stderr)
        return True

    def _precompute(self, ex: Example, stats: RunStats, offline: Sequence[str] = ()) -> None:
        """The offline step: every passage's cache, then the per-document data of the strategies that read
        some (`offline`), so that none of it is timed as part of a request."""
        docs = ex.docs
        stats.passage_slots += len(docs)
        self._seen_passages.update(pid for pid, _ in docs)
        stats.distinct_passages = len(self._seen_passages)
        try:
            rep = self.engine.precompute(docs)
            stats.precompute_hits += int(getattr(rep, "hits", 0) or 0)
            stats.precompute_misses += int(getattr(rep, "misses", 0) or 0)
            reps = [rep] + [self.engine.precompute(docs, strategy=name) for name in offline]
        except ValueError as e:
            raise ValueError(f"precompute on {ex.id}: {e}") from None
        for r in reps:
            stats.precompute_tokens += int(getattr(r, "tokens", 0) or 0)
            stats.precompute_s += float(getattr(r, "seconds", 0.0) or 0.0)


def _as_long(ids: list[int]):
    import torch

    return torch.tensor(ids, dtype=torch.long)

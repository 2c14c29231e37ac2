"""Self-distillation of a fusion adapter (engine/adapter.py).

Teacher: the base model's full prefill of a multi-document prompt, and its own greedy answer (teacher-forced).
Student: the fused path of the same prompt: every document computed alone after the prefix, then the prefix's
cache and the documents' caches re-positioned exactly, the rows the engine's strategy recomputes at a sampled
ratio, the question and the answer. Where the adapter acts is its stage: `offline`, the documents' passes (the
rest is the base model); `online`, the recomputed rows and the question (the documents are the base model's
caches, the answer rows the base model attending to them, as decoding serves them). The loss is KL(teacher ||
student) per answer token; only the adapter's weights learn.

The forward here is plain differentiable torch over the engine's decoder seam (`project` / `finish`) and the
same RoPE; `tests/training` checks it against the engine's own paths (full prefill, and reuse with and without an
adapter) so what is trained is what is served.
"""
from __future__ import annotations

import dataclasses
import json
import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from ..engine.adapter import TARGETS, AdaptedDecoder, FusionAdapter
from ..engine.docpass import documents_pass
from ..engine.fusion.select import select_only
from ..engine.runner import Segment
from ..engine.store import DocKV
from ..kernels.rope import apply_rope_reference

__all__ = ["PromptsConfig", "TrainConfig", "held_out_prompts", "forward_rows", "student_logprobs", "teacher_logprobs", "train_adapter", "training_prompts"]


def forward_rows(dec, ids: Tensor, pos: Tensor, cos: Tensor, sin: Tensor,
                 ctx: tuple[list[Tensor], list[Tensor], Tensor] | None = None,
                 groups: Tensor | None = None) -> tuple[Tensor, list, list]:
    """Runs rows `ids` at positions `pos` through every layer, attending causally (by position) to themselves and
    to `ctx` = (per-layer K [C, kvh, d] pre-RoPE, per-layer V, positions [C]). `groups` [T]: rows attend only to
    rows of their own group (and to all of `ctx`): several independent sequences in one pass.

    Returns:
        (final hidden [T, hidden], per-layer K of these rows pre-RoPE, per-layer V).
    """
    s = dec.spec
    h = dec.embed_tokens(ids)
    ks, vs = [], []
    all_pos = pos if ctx is None else torch.cat([ctx[2], pos])
    mask = all_pos[None, :] <= pos[:, None]
    if groups is not None:
        own = groups[None, :] == groups[:, None]
        mask = own if ctx is None else torch.cat([mask[:, :ctx[2].numel()], own], dim=1)
        mask = mask & (all_pos[None, :] <= pos[:, None])
    cq, sq = cos[pos], sin[pos]
    ck, sk = cos[all_pos], sin[all_pos]
    for i in range(s.n_layers):
        q, k, v = dec.project(i, h)
        ks.append(k)
        vs.append(v)
        if ctx is not None:
            k = torch.cat([ctx[0][i], k])
            v = torch.cat([ctx[1][i], v])
        qr = apply_rope_reference(q, cq, sq).transpose(0, 1)
        kr = apply_rope_reference(k, ck, sk).transpose(0, 1)
        o = F.scaled_dot_product_attention(qr, kr, v.transpose(0, 1), attn_mask=mask, scale=s.scale,
                                           enable_gqa=True)
        h = dec.finish(i, h, o.transpose(0, 1))
    return h, ks, vs


def _answer_rows(layout, answer: Sequence[int]) -> tuple[Tensor, Tensor]:
    """(ids, positions) of the teacher-forced answer rows after the prompt (the answer minus its last token)."""
    n = layout.n
    ids = torch.as_tensor(list(answer[:-1]), dtype=torch.long)
    return ids, torch.arange(n, n + ids.numel())


def teacher_logprobs(engine, layout, answer: Sequence[int]) -> Tensor:
    """log p_full(. | prompt, answer[:t]) for t < len(answer): [T, vocab] float32, no gradient."""
    dec = engine.decoder
    a_ids, a_pos = _answer_rows(layout, answer)
    ids = torch.cat([layout.ids, a_ids]).to(dec.device)
    pos = torch.arange(ids.numel(), device=dec.device)
    cos, sin = engine.runner.rope(int(ids.numel()))
    with torch.no_grad():
        h, _, _ = forward_rows(dec, ids, pos, cos, sin)
        return torch.log_softmax(dec.logits(h[layout.n - 1:]).float(), dim=-1)


def student_logprobs(engine, layout, answer: Sequence[int], adapter: FusionAdapter | None,
                     recompute: Tensor | None = None, doc_kv: list | None = None) -> Tensor:
    """log p_fused(. | prompt, answer[:t]): documents computed alone after the prefix, then the prompt's computed
    rows and the answer rows; `adapter` acts where its stage says (module docstring). `recompute`: sorted document
    positions recomputed online. Differentiable in the adapter.

    Args:
        doc_kv: the documents' (K list, V list) from `document_kv` (computed here when None).
    """
    dec = engine.decoder
    online = adapter is not None and adapter.stage == "online"
    dev = dec.device
    a_ids, a_pos = _answer_rows(layout, answer)
    n_all = layout.n + int(a_ids.numel())
    cos, sin = engine.runner.rope(n_all)
    if doc_kv is None:
        doc_kv = document_kv(engine, layout, adapter)
    prefix = engine.doc_cache.prefix_kv()
    ctx_k = [[prefix.k[i]] for i in range(dec.spec.n_layers)]
    ctx_v = [[prefix.v[i]] for i in range(dec.spec.n_layers)]
    ctx_pos = [torch.arange(layout.prefix.start, layout.prefix.end)]
    keep_doc = torch.ones(layout.n, dtype=torch.bool)
    if recompute is not None and recompute.numel():
        keep_doc[recompute.cpu()] = False
    for sp, (ks, vs) in zip(layout.docs, doc_kv):
        sel = keep_doc[sp.start:sp.end].to(dev)
        for i in range(dec.spec.n_layers):
            ctx_k[i].append(ks[i][sel])
            ctx_v[i].append(vs[i][sel])
        ctx_pos.append(torch.arange(sp.start, sp.end)[keep_doc[sp.start:sp.end]])
    computed = torch.ones(layout.n, dtype=torch.bool)
    computed[layout.prefix.start:layout.prefix.end] = False
    for sp in layout.docs:
        computed[sp.start:sp.end] = False
    if recompute is not None and recompute.numel():
        computed[recompute.cpu()] = True
    rows = torch.arange(layout.n)[computed]
    ctx = ([torch.cat(x) for x in ctx_k], [torch.cat(x) for x in ctx_v], torch.cat(ctx_pos).to(dev))
    if online:  # the prompt's computed rows with the adapter, then the answer rows by the base model over them
        hp, ks, vs = forward_rows(AdaptedDecoder(dec, adapter), layout.ids[rows].to(dev), rows.to(dev), cos, sin, ctx)
        ctx = ([torch.cat([c, k]) for c, k in zip(ctx[0], ks)], [torch.cat([c, v]) for c, v in zip(ctx[1], vs)],
               torch.cat([ctx[2], rows.to(dev)]))
        ha, _, _ = forward_rows(dec, a_ids.to(dev), a_pos.to(dev), cos, sin, ctx)
        h = torch.cat([hp[-1:], ha])  # the last prompt row predicts the first answer token
        return torch.log_softmax(dec.logits(h).float(), dim=-1)
    ids = torch.cat([layout.ids[rows], a_ids]).to(dev)
    pos = torch.cat([rows, a_pos]).to(dev)
    h, _, _ = forward_rows(dec, ids, pos, cos, sin, ctx)
    first = int((rows < layout.n - 1).sum())  # the row of the last prompt token: it predicts the first answer token
    return torch.log_softmax(dec.logits(h[first:]).float(), dim=-1)


def document_kv(engine, layout, adapter: FusionAdapter | None,
                contexts: Sequence[Sequence[Sequence[int]]] | None = None
                ) -> list[tuple[list[Tensor], list[Tensor]]]:
    """Each document's per-layer pre-RoPE (K, V), computed alone after the prefix's cache (the offline pass; an
    online adapter does not act here): the engine's own documents pass (engine/docpass.py), all in one pass,
    differentiable in an offline adapter.

    `contexts` (one entry per document: token ids of the documents before it, nearest last): each document is
    computed after the prefix and those documents' own plain caches, as the engine serves a `doc_context` (the
    fusionrag cache variant, cached mode: engine/corpus.py `FusionRagVariant`). The context caches are computed
    with the same decoder, without gradient (the engine computes them once and reuses them); the document's rows
    are differentiable. An empty entry: that document alone."""
    offline = adapter is not None and adapter.stage == "offline"
    dec = AdaptedDecoder(engine.decoder, adapter) if offline else engine.decoder
    if not layout.doc_ids:
        return []
    prefix, rope = engine.doc_cache.prefix_kv(), engine.runner.rope
    if not contexts or not any(contexts):
        kvs = documents_pass(dec, rope, prefix, layout.doc_ids, max_tokens=sum(len(x) for x in layout.doc_ids))
        return [(list(kv.k.unbind(0)), list(kv.v.unbind(0))) for kv in kvs]
    if len(contexts) != len(layout.doc_ids):
        raise ValueError(f"{len(contexts)} contexts for {len(layout.doc_ids)} documents")
    distinct = list({tuple(c): None for ctx in contexts for c in ctx})
    with torch.no_grad():  # every context document's plain cache, once
        plain = dict(zip(distinct, documents_pass(dec, rope, prefix, [list(c) for c in distinct],
                                                   max_tokens=sum(len(c) for c in distinct)), strict=True))
    pk, pv, out = prefix.k.to(dec.device), prefix.v.to(dec.device), []
    for ids, ctx in zip(layout.doc_ids, contexts, strict=True):
        before = DocKV(torch.cat([pk] + [plain[tuple(c)].k for c in ctx], dim=1),
                       torch.cat([pv] + [plain[tuple(c)].v for c in ctx], dim=1))
        kv = documents_pass(dec, rope, before, [ids], max_tokens=len(ids))[0]
        out.append((list(kv.k.unbind(0)), list(kv.v.unbind(0))))
    return out


def context_stream(examples, seed: int, top_k: int):
    """`draw(n, example, docs, encode)`: for prompt number n of `example`, each document's context: `top_k`
    passages of other examples (their bodies' token ids, `encode(text)`; fewer when fewer are eligible), drawn at
    random, a fresh draw per prompt and document, the same for the same n (a resumed run draws what an
    uninterrupted one would). What a served `doc_context=pool` or `random` gives a document: a few in-domain
    documents unrelated to its question."""
    passages = [(ex.id, text) for ex in examples for _, _, text in ex.passages]

    def draw(n: int, example, docs, encode) -> list[list[list[int]]]:
        rng = random.Random(f"{seed}:context:{n}")
        own = {d.text for d in docs}
        eligible = list({text: None for ex_id, text in passages if ex_id != example.id and text not in own})
        return [[encode(text) for text in rng.sample(eligible, min(top_k, len(eligible)))] for _ in docs]

    return draw


def strategy_selection(engine, layout, doc_kv, strategy: str, ratio: float, runner=None,
                       exact_first: bool = False) -> Tensor | None:
    """The document positions `strategy` recomputes at `ratio` over these (detached) caches, as the engine picks
    them (its probe and initial choice). `runner`: the one the engine's fused prefill runs on (the base model's
    by default; with an online adapter, a Runner over it). `exact_first`: the caches are the base model's, so the first
    document's is exact (never selected) where `PromptLayout.first_document_exact` says so, as the engine serves it."""
    if ratio <= 0:
        return None
    from ..engine.fusion import make_strategy

    segs = [Segment(layout.prefix.start, layout.prefix.end, engine.doc_cache.prefix_kv(), selectable=False)]
    for j, (sp, (ks, vs)) in enumerate(zip(layout.docs, doc_kv)):
        segs.append(Segment(sp.start, sp.end, DocKV(torch.stack([k.detach() for k in ks]),
                                                      torch.stack([v.detach() for v in vs])),
                            exact=exact_first and j == 0 and layout.first_document_exact()))
    segs += [Segment(sp.start, sp.end, None, selectable=False) for sp in layout.glue]
    segs.sort(key=lambda s: s.start)
    segs.append(Segment(layout.tail.start, layout.tail.end, None, selectable=False))
    with torch.no_grad():
        _, chosen = select_only(runner or engine.runner, layout.ids, segs, make_strategy(strategy), ratio)
    return None if chosen is None else torch.sort(chosen.cpu()).values


@dataclass
class PromptsConfig:
    """What every self-distillation run has (the fusion adapter's `TrainConfig`, link rows' `LinksConfig`).

    Attributes:
        steps / lr / warmup / seed: the optimisation (linear warm-up then cosine decay).
        ratios: recompute ratios the student samples per step (0 = pure reuse).
        strategy: the strategy whose selection the student recomputes.
        min_docs / max_docs / max_doc_tokens: the prompts built from an example (a random subset of its passages,
            in random order, trimmed to `max_doc_tokens` document tokens).
        answer_tokens: the teacher's greedy answer length at most.
        eval_every: steps between held-out measurements (0: never).
    """

    steps: int = 200
    lr: float = 3e-4
    warmup: int = 10
    seed: int = 0
    ratios: tuple[float, ...] = (0.0, 0.15)
    strategy: str = "infoflow"
    min_docs: int = 3
    max_docs: int = 8
    max_doc_tokens: int = 900
    answer_tokens: int = 16
    eval_every: int = 0


@dataclass
class TrainConfig(PromptsConfig):
    """One training run (recorded with the adapter): `PromptsConfig`'s fields (AdamW here) and

    Attributes:
        rank / alpha / targets: the adapter's shape.
        stage: where the adapter acts, "offline" or "online" (engine/adapter.py).
        batch: prompts per optimiser step (their losses averaged).
        max_seconds: stop early (and save) after this much training time, counted over resumed runs too; 0 for no
            limit.
        checkpoint_seconds: write the checkpoint (`checkpoint_path`) at least this often; 0 for only at the end.
        eval_every / eval_prompts: with held-out examples, the student's KL on `eval_prompts` fixed prompts built
            from them is measured before training and every `eval_every` steps (0: never), and the adapter written
            is the one of the lowest held-out KL.
        first_token_weight: the loss weighs the answer's first position this many times the others
            (`distill_loss`; the held-out KL too); 1 is the plain mean.
        doc_context / context_docs: "none" (default): each student document is computed alone after the prefix, as
            plain caches are served; "random": after `context_docs` passages of other training examples drawn at
            random per prompt (`context_stream`), as caches served with a strategy's `doc_context` option are
            (engine/fusion/base.py: `infoflow:doc_context=pool`). An adapter trained so is meant to be served so.
    """

    rank: int = 8
    alpha: float = 16.0
    targets: tuple[str, ...] = TARGETS
    stage: str = "offline"
    batch: int = 1
    max_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    eval_prompts: int = 16
    first_token_weight: float = 1.0
    doc_context: str = "none"
    context_docs: int = 3

    def __post_init__(self) -> None:
        if self.doc_context not in DOC_CONTEXTS:
            raise ValueError(f"doc_context must be one of {DOC_CONTEXTS}, got {self.doc_context!r}")
        if isinstance(self.context_docs, bool) or not isinstance(self.context_docs, int) or self.context_docs < 1:
            raise ValueError(f"context_docs must be an int >= 1, got {self.context_docs!r}")
        w = self.first_token_weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not (math.isfinite(w) and w > 0):
            raise ValueError(f"first_token_weight must be a finite number > 0, got {w!r}")

    def same_run(self, other: TrainConfig) -> list[str]:
        """The fields that differ from `other`'s, ignoring how long either run is allowed to go on."""
        skip = {"steps", "max_seconds", "checkpoint_seconds", "eval_every", "eval_prompts"}
        a, b = asdict(self), asdict(other)
        return [k for k in a if k not in skip and _norm(a[k]) != _norm(b[k])]


DOC_CONTEXTS = ("none", "random")


def distill_loss(teacher: Tensor, student: Tensor, first_token_weight: float = 1.0) -> Tensor:
    """KL(teacher || student) per answer position ([T, vocab] log-probs each), averaged with the first position
    weighted `first_token_weight` times the others (1: the plain mean). Most fused answers that part from full
    prefill's do so at their first token, so weighting it spends the adapter's capacity where answers change."""
    kl = (teacher.exp() * (teacher - student)).sum(-1)
    if first_token_weight == 1.0 or kl.numel() == 1:
        return kl.mean()
    w = torch.ones_like(kl)
    w[0] = first_token_weight
    return (kl * w).sum() / w.sum()


def _norm(x):
    return list(x) if isinstance(x, (list, tuple)) else x


def checkpoint_path(out: str | Path) -> Path:
    """Where the training checkpoint of adapter file `out` lives (beside it)."""
    out = Path(out)
    return out.with_name(out.stem + ".ckpt.safetensors")


def _save_checkpoint(path: Path, adapter: FusionAdapter, opt, state: dict[str, Any]) -> None:
    """Adapter weights (fp32), the optimiser's moments and the run's state, written atomically (safetensors: no
    pickle)."""
    import os

    from safetensors.torch import save_file

    tensors = {f"A.{t}": adapter.A[t].detach().float().cpu().contiguous() for t in adapter.targets}
    tensors.update({f"B.{t}": adapter.B[t].detach().float().cpu().contiguous() for t in adapter.targets})
    for i, p in enumerate(adapter.parameters()):
        st = opt.state.get(p, {})
        if st:
            tensors[f"m.{i}"] = st["exp_avg"].detach().cpu().contiguous()
            tensors[f"v.{i}"] = st["exp_avg_sq"].detach().cpu().contiguous()
            state.setdefault("opt_steps", {})[str(i)] = float(st["step"])
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "kvfuse-adapter-checkpoint-1", "state": json.dumps(state)})
    os.replace(tmp, path)


def _load_checkpoint(path: Path, adapter: FusionAdapter, opt) -> dict[str, Any]:
    """Restores what `_save_checkpoint` wrote into `adapter` and `opt`; returns the run's state. ValueError for a
    file that is not a checkpoint or does not fit the adapter."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = dict(f.metadata() or {})
            raw = {k: f.get_tensor(k) for k in f.keys()}
        if meta.get("format") != "kvfuse-adapter-checkpoint-1":
            raise ValueError(f"format {meta.get('format')!r}")
        state = json.loads(meta["state"])
        with torch.no_grad():
            for t in adapter.targets:
                adapter.A[t].copy_(raw[f"A.{t}"])
                adapter.B[t].copy_(raw[f"B.{t}"])
        for i, p in enumerate(adapter.parameters()):
            if f"m.{i}" in raw:
                opt.state[p] = {"step": torch.tensor(state["opt_steps"][str(i)]),
                                "exp_avg": raw[f"m.{i}"].to(p.device), "exp_avg_sq": raw[f"v.{i}"].to(p.device)}
    except Exception as exc:  # noqa: BLE001 - any unreadable or mismatched file is one clear error
        raise ValueError(f"{str(path)!r} is not a usable training checkpoint for this adapter: {exc}") from None
    return state


def training_prompts(examples, cfg: TrainConfig, tokenizer_len: Callable[[str], int]):
    """An endless stream of (question, documents) built from `examples`: random passage subsets and orders."""
    from ..engine.types import Document

    rng = random.Random(cfg.seed)
    pool = [ex for ex in examples if len(ex.passages) >= 2]
    if not pool:
        raise ValueError("no training example has two passages or more")
    while True:
        ex = rng.choice(pool)
        k = rng.randint(min(cfg.min_docs, len(ex.passages)), min(cfg.max_docs, len(ex.passages)))
        picked = rng.sample(list(ex.passages), k)
        docs, used = [], 0
        for pid, title, text in picked:
            n = tokenizer_len(text)
            if docs and used + n > cfg.max_doc_tokens:
                continue
            docs.append(Document(pid, text, title=title or ""))
            used += n
        yield ex, docs


def full_teacher(engine, question: str, docs, answer_tokens: int):
    """(full's greedy answer, the teacher's log-probs over it, through the engine's own full prefill:
    `teacher_logprobs` computes the same with the plain forward, tests/training), or None for no answer."""
    answer = list(engine.generate(question, docs, strategy="full", max_new_tokens=answer_tokens,
                                  temperature=0.0).token_ids)
    if not answer:
        return None
    return answer, engine.next_token_logprobs(question, docs, answer + [0], strategy="full").to(engine.device)


def held_out_prompts(eval_examples, cfg: PromptsConfig, tok_len: Callable[[str], int], teacher_for) -> list:
    """Fixed held-out prompts and their teachers, built once: [(example, docs, answer, teacher)] (`cfg.eval_prompts`
    of them, drawn from `eval_examples` with seed + 2); [] without examples or `cfg.eval_every`."""
    evalset: list = []
    if not eval_examples or not cfg.eval_every:
        return evalset
    stream = training_prompts(eval_examples, dataclasses.replace(cfg, seed=cfg.seed + 2), tok_len)
    for _ in range(4 * cfg.eval_prompts):
        if len(evalset) == cfg.eval_prompts:
            break
        ex, docs = next(stream)
        got = teacher_for(ex, docs)
        if got is not None:
            evalset.append((ex, docs, *got))
    return evalset


def train_adapter(engine, examples, cfg: TrainConfig, out: str | Path, *, log: Callable[[str], None] = print,
                  eval_examples=None, resume: bool = False) -> dict[str, Any]:
    """Trains a fusion adapter for `engine`'s model on `examples` and writes `out` (safetensors) and
    `out`.json (the training record: config, data, loss curve, time).

    A checkpoint (`checkpoint_path(out)`: weights, optimiser moments, the loss curve, how far the prompt and ratio
    streams got) is written every `cfg.checkpoint_seconds` and at the end. With `resume`, a run continues from it
    (the same config, bar its length limits) exactly where it stopped: a run cut short (a crash, a time limit) and
    resumed trains the adapter an uninterrupted run would.

    `eval_examples` (never trained on) with `cfg.eval_every`: the held-out KL is tracked (record["held_out"]) and
    `out` is the adapter of its lowest point (record["best_step"]; step 0 is no adapter at all); the last weights
    stay in the checkpoint.
    """
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed + 1)
    adapter = FusionAdapter.init(engine.decoder, cfg.rank, cfg.alpha, cfg.targets, seed=cfg.seed, stage=cfg.stage)
    params = adapter.parameters()
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    # selection runs eagerly, unpadded (the probe is stopped after the strategy's choice); an online adapter also
    # moves what the probe of a query-aware strategy sees, so it selects with the adapter, as the engine will
    from ..engine.runner import Runner

    online = cfg.stage == "online"
    selector = Runner(AdaptedDecoder(engine.decoder, adapter) if online else engine.decoder,
                      cuda_graphs=False, bucketed=False)

    def lr_at(step: int, elapsed: float) -> float:
        """Linear warm-up, then cosine decay over the run: by steps, or by time when that limit comes first."""
        if step < cfg.warmup:
            return cfg.lr * (step + 1) / cfg.warmup
        t = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
        if cfg.max_seconds:
            t = max(t, elapsed / cfg.max_seconds)
        return cfg.lr * 0.5 * (1 + math.cos(math.pi * min(1.0, t)))

    tok_len = (lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"]))
    prompts = training_prompts(examples, cfg, tok_len)

    def teacher_for(ex, docs):
        return full_teacher(engine, ex.question, docs, cfg.answer_tokens)

    from ..engine.types import Document

    contexts_for = (context_stream(examples, cfg.seed, cfg.context_docs) if cfg.doc_context != "none" else None)
    # how the adapter's documents were computed, in its file's metadata (serve it with a strategy's doc_context)
    trained_for = {"doc_context": cfg.doc_context} if contexts_for else {}

    def encode(text: str) -> list[int]:
        return engine.prompts.encode_document(Document("ctx", text))

    def student_kl(ex, docs, answer, teacher, ratio, n):
        """(KL(teacher || student) per answer token, the prompt's layout) at `ratio` for prompt number `n`;
        differentiable in the adapter (documents are computed with it when it is offline, an online one leaves them
        alone)."""
        layout = engine.layout(ex.question, docs)
        contexts = contexts_for(n, ex, docs, encode) if contexts_for else None
        exact = layout.first_document_exact(documents_adapted=not online)  # as the engine serves it
        if contexts and exact:
            contexts[0] = []  # the exact first document gets its plain cache, not a context variant
        doc_kv = document_kv(engine, layout, adapter, contexts)
        recompute = strategy_selection(engine, layout, doc_kv, cfg.strategy, ratio, selector, exact_first=exact)
        student = student_logprobs(engine, layout, answer + [0], adapter, recompute, doc_kv)
        return distill_loss(teacher, student, cfg.first_token_weight), layout

    def one_prompt():
        """(KL of one drawn prompt, its record) or None when the teacher answers nothing."""
        ex, docs = next(prompts)
        drawn["prompts"] += 1
        got = teacher_for(ex, docs)
        if got is None:
            return None
        answer, teacher = got
        ratio = rng.choice(cfg.ratios)
        drawn["ratios"] += 1
        kl, layout = student_kl(ex, docs, answer, teacher, ratio, drawn["prompts"])
        return kl, {"ratio": ratio, "docs": len(docs), "prompt_tokens": layout.n, "answer_tokens": len(answer),
                    "example": ex.id}

    evalset = held_out_prompts(eval_examples, cfg, tok_len, teacher_for)
    eval_ratio = 0.15 if 0.15 in cfg.ratios else max(cfg.ratios)

    def held_out_kl() -> float:
        """Mean KL(teacher || student) over the held-out prompts at `eval_ratio`, no gradient."""
        with torch.no_grad():
            kls = [float(student_kl(ex, docs, answer, teacher, eval_ratio, -1 - i)[0])
                   for i, (ex, docs, answer, teacher) in enumerate(evalset)]
        return sum(kls) / len(kls)

    out = Path(out)
    best_path = out.with_name(out.stem + ".best.safetensors")
    held_out, best = [], {"kl": math.inf, "step": 0}

    def track(steps: int) -> None:
        """Measures the held-out KL after `steps` steps and keeps the adapter when it is the lowest so far."""
        kl = held_out_kl()
        held_out.append({"step": steps, "kl": round(kl, 5)})
        log(f"held-out KL after step {steps}: {kl:.4f} ({len(evalset)} prompts)")
        if kl < best["kl"]:
            best.update(kl=kl, step=steps)
            adapter.meta = {"base": engine.namespace.model, "model": engine.model_name, "steps": str(steps),
                            "seed": str(cfg.seed), **trained_for}
            adapter.save(best_path)

    ckpt = checkpoint_path(out)
    curve, first, drawn, offset = [], 0, {"prompts": 0, "ratios": 0}, 0.0
    if resume and ckpt.is_file():
        state = _load_checkpoint(ckpt, adapter, opt)
        diff = cfg.same_run(TrainConfig(**{**state["config"], "targets": tuple(state["config"]["targets"]),
                                           "ratios": tuple(state["config"]["ratios"])}))
        if diff:
            raise ValueError(f"the checkpoint {str(ckpt)!r} is of another run (it differs in {', '.join(diff)}); "
                             "train without resume, or with that run's settings")
        curve, first, drawn, offset = state["curve"], state["steps"], state["drawn"], state["seconds"]
        held_out[:] = state.get("held_out", [])
        best.update(state.get("best", {"kl": math.inf, "step": 0}))
        for _ in range(drawn["prompts"]):  # the streams where the run stopped
            next(prompts)
        for _ in range(drawn["ratios"]):
            rng.choice(cfg.ratios)
        log(f"resuming after step {first} ({offset:.0f} s of training so far)")
    elif resume:
        log(f"no checkpoint at {ckpt}: starting afresh")

    config = {**asdict(cfg), "targets": list(cfg.targets), "ratios": list(cfg.ratios)}

    def checkpoint(steps: int) -> None:
        _save_checkpoint(ckpt, adapter, opt, {"config": config, "steps": steps, "drawn": drawn, "curve": curve,
                                              "held_out": held_out, "best": best,
                                              "seconds": round(time.perf_counter() - t0, 3)})

    t0 = time.perf_counter() - offset
    last_ckpt = time.perf_counter()
    stopped = len(curve)
    if evalset and not held_out:
        track(0)
    for step in range(first, cfg.steps):
        if cfg.max_seconds and time.perf_counter() - t0 > cfg.max_seconds:
            log(f"stopping before step {step + 1}: the {cfg.max_seconds:.0f} s limit")
            break
        for g in opt.param_groups:
            g["lr"] = lr_at(step, time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
        kls, info = [], []
        while len(kls) < cfg.batch:
            got = one_prompt()
            if got is None:
                continue
            (got[0] / cfg.batch).backward()
            kls.append(got[0].item())
            info.append(got[1])
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        curve.append({"step": step, "kl": round(sum(kls) / len(kls), 5), "lr": opt.param_groups[0]["lr"],
                      "prompts": info,
                      "seconds": round(time.perf_counter() - t0, 1)})
        if step % 10 == 0 or step == cfg.steps - 1:
            recent = [c["kl"] for c in curve[-10:]]
            log(f"step {step + 1}/{cfg.steps}  kl {sum(recent) / len(recent):.4f} (mean of last {len(recent)})  "
                f"{time.perf_counter() - t0:.0f} s")
        if evalset and (step + 1) % cfg.eval_every == 0:
            track(step + 1)
        if cfg.checkpoint_seconds and time.perf_counter() - last_ckpt >= cfg.checkpoint_seconds:
            checkpoint(step + 1)
            last_ckpt = time.perf_counter()
    if evalset and held_out[-1]["step"] != len(curve):
        track(len(curve))
    if len(curve) > stopped or not ckpt.is_file():
        checkpoint(len(curve))
    record = {"config": config,
              "model": engine.model_name, "base_namespace": engine.namespace.model,
              "train_examples": len(examples), "seconds": round(time.perf_counter() - t0, 1), "curve": curve}
    for p in params:
        p.requires_grad_(False)
    if evalset:  # the adapter of the lowest held-out KL
        import os

        record.update(held_out=held_out, best_step=best["step"], held_out_prompts=len(evalset),
                      held_out_ratio=eval_ratio)
        if best_path.exists():  # else the best is already `out` (a finished run resumed without a new low)
            os.replace(best_path, out)
        log(f"kept the adapter of step {best['step']} (held-out KL {best['kl']:.4f})")
    else:
        adapter.meta = {"base": engine.namespace.model, "model": engine.model_name, "steps": str(len(curve)),
                        "seed": str(cfg.seed), **trained_for}
        adapter.save(out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    log(f"wrote {out} ({out.stat().st_size / 1e6:.1f} MB) and {out.with_suffix('.json')}")
    return record



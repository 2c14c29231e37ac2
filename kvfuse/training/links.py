"""Self-distillation of link rows (engine/links.py): K learned input vectors after every cached document.

Teacher: the base model's full prefill of a multi-document prompt and its own greedy answer, teacher-forced (as
for the fusion adapter, kvfuse/training/distill.py). Student: the fused path of the same prompt laid out with the
link rows (K placeholder ids after each document, computed at request time), documents computed alone after the
prefix (with the engine's offline adapter, when it has one), the rows the strategy recomputes at a sampled ratio
(picked over the linked prompt, as the engine picks them). Loss: KL(teacher || student) per answer token. Only the
K x hidden vectors learn; the model, and so `full`, is untouched.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from ..engine.links import LinkRows, placeholder_ids
from ..engine.runner import Runner
from .distill import (PromptsConfig, distill_loss, document_kv, full_teacher, held_out_prompts,
                      strategy_selection, student_logprobs, training_prompts)

__all__ = ["LinksConfig", "train_links", "linked_layout"]


@dataclass
class LinksConfig(PromptsConfig):
    """One link-rows training run (recorded with the file): `PromptsConfig`'s fields (Adam here, at 3e-3 by
    default, 300 steps) and

    Attributes:
        k: link rows per document.
        init_token: the text whose first token's embedding every link row starts from (plus small noise).
        eval_every / eval_prompts: with held-out examples, their KL at `eval_ratio` on `eval_prompts` fixed prompts is
            measured before training and every this many steps, and the vectors of the lowest point are written
            (0: never; the last vectors are written).
    """

    steps: int = 300
    lr: float = 3e-3
    k: int = 8
    init_token: str = "\n\n"
    eval_prompts: int = 24
    eval_ratio: float = 0.15


def linked_layout(engine, question: str, docs, k: int):
    """The layout of a fused request laid out with K link rows after every document (their placeholder ids)."""
    return engine.prompts.build(question, [engine.prompts.encode_document(d) for d in docs],
                                [engine.prompts.encode_title(d) for d in docs],
                                placeholder_ids(engine.decoder.spec.vocab, k))


def train_links(engine, examples, cfg: LinksConfig, out: str | Path, *, log: Callable[[str], None] = print,
                eval_examples=None) -> dict[str, Any]:
    """Trains link rows for `engine`'s model (with its offline adapter, if any, computing the documents) on
    `examples` and writes `out` (safetensors, engine/links.py) and returns the training record (config, loss curve,
    held-out points, time). The engine's decoder embeds the vectors being trained while this runs and gets its
    own link rows (or none) back after."""
    if not 1 <= cfg.k <= 64:
        raise ValueError(f"k must be in [1, 64], got {cfg.k}")
    torch.manual_seed(cfg.seed)
    rng = random.Random(cfg.seed + 1)
    dec = engine.decoder
    adapter = engine.adapter if getattr(engine, "_documents_adapted", False) else None
    first = engine.tokenizer(cfg.init_token, add_special_tokens=False)["input_ids"][:1]
    if not first:
        raise ValueError(f"init_token {cfg.init_token!r} has no token")
    with torch.no_grad():
        base = dec.embed_tokens(torch.tensor(first, device=dec.device)).float()[0]
    g = torch.Generator(device="cpu").manual_seed(cfg.seed)
    noise = torch.randn(cfg.k, base.numel(), generator=g).to(dec.device) * (0.01 * float(base.norm()) /
                                                                           math.sqrt(base.numel()))
    vectors = torch.nn.Parameter(base[None].repeat(cfg.k, 1) + noise)
    opt = torch.optim.Adam([vectors], lr=cfg.lr)
    selector = Runner(dec, cuda_graphs=False, bucketed=False)
    tok_len = (lambda text: len(engine.tokenizer(text, add_special_tokens=False)["input_ids"]))
    prompts = training_prompts(examples, cfg, tok_len)

    def teacher_for(ex, docs):
        return full_teacher(engine, ex.question, docs, cfg.answer_tokens)

    def student_kl(ex, docs, answer, teacher, ratio):
        layout = linked_layout(engine, ex.question, docs, cfg.k)
        kv = document_kv(engine, layout, adapter)
        recompute = strategy_selection(engine, layout, kv, cfg.strategy, ratio, selector,
                                       exact_first=adapter is None)
        return distill_loss(teacher, student_logprobs(engine, layout, answer + [0], adapter, recompute, kv))

    evalset = held_out_prompts(eval_examples, cfg, tok_len, teacher_for)

    record: dict[str, Any] = {"config": asdict(cfg), "loss": [], "held_out": [], "examples": []}
    before = dec.links
    best = (math.inf, -1, vectors.detach().clone())
    t0 = time.perf_counter()
    try:
        dec.links = vectors

        def held_out(step: int) -> None:
            nonlocal best
            with torch.no_grad():
                kls = [float(student_kl(ex, docs, a, t, cfg.eval_ratio)) for ex, docs, a, t in evalset]
            kl = sum(kls) / len(kls)
            record["held_out"].append({"step": step, "kl": kl})
            log(f"held-out KL at step {step}: {kl:.4f} ({len(kls)} prompts, ratio {cfg.eval_ratio})")
            if kl < best[0]:
                best = (kl, step, vectors.detach().clone())

        if evalset:
            held_out(0)
        step = 0
        while step < cfg.steps:
            ex, docs = next(prompts)
            got = teacher_for(ex, docs)
            if got is None:
                continue
            lr = cfg.lr * min(1.0, (step + 1) / cfg.warmup) * 0.5 * (1 + math.cos(math.pi * step / cfg.steps))
            for group in opt.param_groups:
                group["lr"] = lr
            ratio = rng.choice(cfg.ratios)
            loss = student_kl(ex, docs, *got, ratio)
            opt.zero_grad()
            loss.backward()
            opt.step()
            step += 1
            record["loss"].append(float(loss.detach()))
            record["examples"].append({"example": ex.id, "docs": len(docs), "ratio": ratio})
            if step % 20 == 0:
                log(f"step {step}: mean KL of the last 20 {sum(record['loss'][-20:]) / 20:.4f} "
                    f"({time.perf_counter() - t0:.0f} s)")
            if evalset and step % cfg.eval_every == 0:
                held_out(step)
        if evalset and record["held_out"][-1]["step"] != step:
            held_out(step)
    finally:
        dec.links = before
    kept = best[2] if evalset else vectors.detach()
    record.update(seconds=time.perf_counter() - t0, best_step=best[1] if evalset else cfg.steps,
                  adapter=adapter.digest[:16] if adapter is not None else "")
    links = LinkRows(kept.float().cpu(), {"k": str(cfg.k), "model": engine.model_name,
                                          "best_step": str(record["best_step"]),
                                          "documents_adapter": record["adapter"]})
    links.save(out)
    record["digest"] = links.digest
    return record

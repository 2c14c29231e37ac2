"""Why a strategy loses quality: where its recomputed tokens fall, and what a perfect selection would give.

For each example the script
1. runs a full prefill and keeps the in-context pre-RoPE K/V of every document row, and compares it with the
   cached (document-alone) K/V: the per-layer relative deviation of every cached token;
2. runs each strategy's selection and measures
   - `dev_cov`: the share of the total deviation (keys + values, summed over layers) its recomputed tokens
     carry, i.e. how much of the stale-cache error it removes;
   - `ans_doc`: the share of its recomputed tokens inside the passages that contain a gold answer string;
   - fidelity (answer F1 vs full) and KL vs full (teacher forced over full's answer);
3. runs the same for two bounds that need the full prefill (so they are not strategies), at the same budget:
   `oracle`, the top tokens by true K+V deviation, and `informed`, ProphetKV's question attention weighted by
   each token's true value deviation (the error each token actually feeds the question).

If the bounds' fidelity is not much above the strategies', the limit is the budget (the model's own
sensitivity to stale context), not the selection.

    python benchmarks/selection_diagnostics.py --data ../shared/data --datasets 2wikimqa --limit 20 \
        --strategies cacheblend,epic,infoflow,prophetkv,qcfuse --ratio 0.15 --out docs/quality/diagnostics.md
"""
from __future__ import annotations

import argparse
from collections import Counter
import math
import statistics
import sys
import time

import torch

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.fusion.base import SelectContext, Strategy, topk_positions
from kvfuse.engine.fusion.prophetkv import ProphetKV
from kvfuse.engine.prompt import PROMPT_PRESETS
from kvfuse.engine.types import as_documents
from kvfuse.evaluation.data import load_examples
from kvfuse.evaluation.metrics import fidelity, mean_kl, normalize_answer


class InformedSelection(ProphetKV):
    """ProphetKV's question attention times each token's true value deviation (a bound: needs full prefill)."""

    name = "informed"

    def __init__(self, value_dev: torch.Tensor) -> None:
        super().__init__()
        self.value_dev = value_dev  # [n_layers, C]

    def scores(self, ctx: SelectContext) -> torch.Tensor:
        total = torch.zeros(int(ctx.candidates.numel()))
        for layer in self.probe_layers(ctx.n_layers):
            s = ctx.question_attention[layer].float()[:, ctx.candidates].mean(0).cpu() * self.value_dev[layer]
            total += s / s.sum().clamp_min(1e-12)
        return total


class FixedSelection(Strategy):
    """Recomputes exactly the given document positions (the oracle)."""

    name = "oracle"

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    def initial(self, ctx: SelectContext) -> torch.Tensor:
        return self.positions


def answer_positions(engine: FusionEngine, layout, docs, answers) -> torch.Tensor:
    """Positions of the passages whose text contains a gold answer (normalised substring)."""
    golds = [normalize_answer(a) for a in answers if normalize_answer(a)]
    keep = []
    for span, d in zip(layout.docs, docs):
        text = normalize_answer(d.text)
        if any(g and g not in ("yes", "no") and g in text for g in golds):
            keep.append(torch.arange(span.start, span.end))
    return torch.cat(keep) if keep else torch.zeros(0, dtype=torch.long)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--datasets", default="2wikimqa")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--strategies", default="reuse,cacheblend,epic,infoflow,prophetkv,qcfuse")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--out", help="also write the markdown table here")
    a = ap.parse_args(argv)

    engine = FusionEngine.from_pretrained(a.model, prompt=PROMPT_PRESETS["qa"])
    names = [s for s in a.strategies.split(",") if s] + ["oracle", "informed"]
    keys = ("dev_cov", "ans_doc", "base", "head16", "last_doc", "fid", "kl")
    rows: dict[str, dict[str, list[float]]] = {n: {k: [] for k in keys} for n in names}
    token_counts: dict[str, Counter] = {n: Counter() for n in names}
    layer_dev: list[torch.Tensor] = []
    t0 = time.perf_counter()
    examples = load_examples(a.data, datasets=a.datasets.split(","), limit=a.limit, seed=a.seed)
    for i, ex in enumerate(examples):
        docs = as_documents(ex.docs)
        engine.precompute(docs)
        ref = engine.generate(ex.question, docs, strategy="full", max_new_tokens=a.max_new_tokens,
                              return_logprobs=True)
        ckv = engine.context_kv(ex.question, docs)
        dev, value_dev, layout = ckv.relative_deviation(), ckv.value_deviation(), ckv.layout
        layer_dev.append(ckv.layer_deviation(dev))
        tok_dev = ckv.token_deviation(dev)  # [D] over layers
        del ckv
        doc_start = layout.docs[0].start
        ans = answer_positions(engine, layout, docs, ex.answers)
        n_docs = int(tok_dev.numel())
        budget = max(0, min(n_docs, int(round(a.ratio * n_docs))))
        cands = torch.arange(doc_start, doc_start + n_docs)
        for name in names:
            if name == "oracle":
                strat = FixedSelection(topk_positions(tok_dev, cands, budget))
            elif name == "informed":
                strat = InformedSelection(value_dev)
            else:
                strat = make_strategy(name)
            kw = {"teacher_ids": ref.token_ids} if ref.token_ids else {}
            if name not in ("oracle", "informed"):
                engine.precompute(docs, strategy=name)
            r = engine.generate(ex.question, docs, strategy=strat, recompute_ratio=a.ratio,
                                max_new_tokens=a.max_new_tokens, **kw)
            picked = torch.tensor(r.recomputed_positions, dtype=torch.long)
            rel = picked - doc_start
            rows[name]["dev_cov"].append(float(tok_dev[rel].sum() / tok_dev.sum()))
            if ans.numel() and picked.numel():
                rows[name]["ans_doc"].append(float(torch.isin(picked, ans).float().mean()))
                rows[name]["base"].append(ans.numel() / n_docs)
            if picked.numel():
                starts = torch.tensor([sp.start for sp in layout.docs])
                offset = picked - starts[torch.searchsorted(starts, picked, right=True) - 1]
                rows[name]["head16"].append(float((offset < 16).float().mean()))
                rows[name]["last_doc"].append(float((picked >= layout.docs[-1].start).float().mean()))
                token_counts[name].update(engine.tokenizer.decode([int(layout.ids[p])]) for p in picked.tolist())
            rows[name]["fid"].append(fidelity(r.text, ref.text))
            if ref.token_ids:
                rows[name]["kl"].append(mean_kl(ref.extra["logprobs"], r.extra["teacher_logprobs"]))
        print(f"[{i + 1}/{len(examples)}] {ex.id} {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)

    def m(xs: list[float]) -> str:
        return f"{100 * statistics.fmean(xs):.1f}" if xs else "n/a"

    lines = [f"Selection diagnostics: {a.datasets}, {len(examples)} examples, ratio {a.ratio}, model {a.model}",
             "", "| selection | deviation covered % | in answer passages % (their token share %) | "
             "in first 16 tokens of a passage % | in the last passage % | fidelity | KL | most picked tokens |",
             "|---|---:|---:|---:|---:|---:|---:|---|"]
    for n in names:
        kl = rows[n]["kl"]
        top = ", ".join(repr(t) for t, _ in token_counts[n].most_common(6)).replace("|", "\\|")
        lines.append(f"| {n} | {m(rows[n]['dev_cov'])} | {m(rows[n]['ans_doc'])} ({m(rows[n]['base'])}) | "
                     f"{m(rows[n]['head16'])} | {m(rows[n]['last_doc'])} | {m(rows[n]['fid'])} | "
                     f"{statistics.fmean(kl) if kl else math.nan:.3f} | {top} |")
    ld = torch.stack([d[: min(x.numel() for x in layer_dev)] for d in layer_dev]).mean(0)
    lines += ["", "Mean relative K+V deviation of the cached rows by layer (document alone vs in context):", "",
              " ".join(f"L{i}:{v:.2f}" for i, v in enumerate(ld.tolist()))]
    text = "\n".join(lines)
    print(text)
    if a.out:
        with open(a.out, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Link rows on held-out prompts: KL(full || fused) per answer token and first-token agreement with full prefill,
with and without K learned link rows, at recompute ratios 0 (reuse) and 0.15 (infoflow), before and after
training on a fixed set of prompts (engine/links.py, the training forward of kvfuse/training/links.py).

The exploratory run of docs/quality/links.md, on the embedded model without its fusion adapter (`--adapter none`)
or with it. The split is this script's own, not `kvfuse train-links`'s: held-out = examples `skip .. skip + eval`
of each dataset in the seeded order of the `*.migres.jsonl` files alone, training = the rest of that order after
`train-skip` plus the `*.hipporag_train.jsonl` examples. For hotpotqa and musique that order is not the
evaluation harness's (which also reads the hipporag files), so these held-out prompts may overlap its reported
split and the vectors trained here are never evaluated there; `kvfuse train-links` keeps the harness's split.

    python benchmarks/links_heldout.py --k 8 --steps 300 --train 80 --eval 10 --adapter none
"""
from __future__ import annotations

import argparse
import glob
import math
import random
import time

import torch

from kvfuse import FusionEngine
from kvfuse.evaluation.data import read_jsonl, select_examples
from kvfuse.engine.types import Document
from kvfuse.training.distill import distill_loss, document_kv, strategy_selection, student_logprobs, teacher_logprobs
from kvfuse.training.links import linked_layout


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--adapter", default="none", help="the fusion adapter the documents are computed with")
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--sets", default="2wikimqa,hotpotqa,musique")
    ap.add_argument("--k", type=int, default=8)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--train", type=int, default=80, help="training examples (fixed prompts, one per example)")
    ap.add_argument("--eval", type=int, default=10, help="held-out examples per dataset")
    ap.add_argument("--skip", type=int, default=60)
    ap.add_argument("--train-skip", type=int, default=70)
    ap.add_argument("--ratios", default="0,0.15")
    ap.add_argument("--max-doc-tokens", type=int, default=900)
    ap.add_argument("--no-hipporag", action="store_true", help="train on the migres examples alone")
    ap.add_argument("--out", default=None, help="write the trained rows here (.safetensors)")
    a = ap.parse_args()
    torch.manual_seed(0)
    rng = random.Random(0)
    eng = FusionEngine.from_pretrained(a.model, adapter=a.adapter, links=None, device=a.device)
    dec = eng.decoder
    adapter = eng.adapter if eng._documents_adapted else None
    ratios = [float(x) for x in a.ratios.split(",")]
    sets = a.sets.split(",")
    migres = [ex for f in sorted(glob.glob(f"{a.data}/*.migres.jsonl")) for ex in read_jsonl(f)]
    extra = [ex for f in sorted(glob.glob(f"{a.data}/*.hipporag_train.jsonl")) for ex in read_jsonl(f)]
    held = select_examples(migres, datasets=sets, limit=a.eval, skip=a.skip)
    train = select_examples(migres, datasets=sets, skip=a.train_skip)
    train += [] if a.no_hipporag else [e for e in extra if e.dataset in sets]
    random.Random(1).shuffle(train)
    train = train[:a.train]
    n_tok = (lambda t: len(eng.tokenizer(t, add_special_tokens=False)["input_ids"]))

    first = eng.tokenizer("\n\n", add_special_tokens=False)["input_ids"][:1]
    with torch.no_grad():
        base = dec.embed_tokens(torch.tensor(first, device=dec.device)).float()[0]
    noise = torch.randn(a.k, base.numel(), device=dec.device) * (0.01 * float(base.norm()) / math.sqrt(base.numel()))
    vectors = torch.nn.Parameter(base[None].repeat(a.k, 1) + noise)

    def prep(ex, cap):
        docs, used = [], 0
        for pid, title, text in ex.passages:
            body = f"{title}\n{text}" if title else text
            n = n_tok(body)
            if cap and docs and used + n > cap:
                continue
            docs.append(Document(pid, body))
            used += n
        ans = list(eng.generate(ex.question, docs, strategy="full", max_new_tokens=16, temperature=0.0).token_ids)
        if not ans:
            return None
        plain = eng.layout(ex.question, docs)
        linked = linked_layout(eng, ex.question, docs, a.k)
        with torch.no_grad():
            teacher = teacher_logprobs(eng, plain, ans + [0])
            kv = document_kv(eng, plain, adapter)
        rec = {r: _picks(eng, plain, linked, kv, r, adapter) for r in ratios}
        return dict(ex=ex, ans=ans, layouts=(plain, linked), teacher=teacher, kv=kv, rec=rec)

    def student(p, links: bool, ratio: float):
        dec.links = vectors if links else None
        try:
            return student_logprobs(eng, p["layouts"][links], p["ans"] + [0], adapter, p["rec"][ratio][links],
                                    p["kv"])
        finally:
            dec.links = None

    def report(tag: str, evalp, both: bool) -> None:
        with torch.no_grad():
            rows = []
            for p in evalp:
                r = {}
                for ratio in ratios:
                    for links in ((False, True) if both else (True,)):
                        s = student(p, links, ratio)
                        r[(ratio, links)] = (float(distill_loss(p["teacher"], s)),
                                             int(s[0].argmax()) == p["ans"][0])
                rows.append((p["ex"].dataset, r))
        for key in rows[0][1]:
            for ds in sets + ["all"]:
                sel = [r[key] for d, r in rows if ds == "all" or d == ds]
                print(f"[{tag}] {'links' if key[1] else 'plain'} ratio {key[0]} {ds:10s} n {len(sel)} "
                      f"KL {sum(x[0] for x in sel) / len(sel):.4f} first-token {sum(x[1] for x in sel) / len(sel):.3f}",
                      flush=True)

    t0 = time.time()
    evalp = [p for p in (prep(ex, None) for ex in held) if p]
    print(f"held-out prompts {len(evalp)} ({time.time() - t0:.0f} s)", flush=True)
    report("start", evalp, True)
    trainp = [p for p in (prep(ex, a.max_doc_tokens) for ex in train) if p]
    print(f"training prompts {len(trainp)}", flush=True)
    opt = torch.optim.Adam([vectors], lr=a.lr)
    losses = []
    for step in range(a.steps):
        for g in opt.param_groups:
            g["lr"] = a.lr * min(1.0, (step + 1) / 10) * 0.5 * (1 + math.cos(math.pi * step / a.steps))
        p = rng.choice(trainp)
        loss = distill_loss(p["teacher"], student(p, True, rng.choice(ratios)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 20 == 0:
            print(f"step {step + 1} mean KL of the last 20 {sum(losses[-20:]) / 20:.4f}", flush=True)
    report("trained", evalp, False)
    if a.out:
        from kvfuse.engine.links import LinkRows

        LinkRows(vectors.detach().float().cpu(), {"k": str(a.k)}).save(a.out)


def _picks(eng, plain, linked, kv, ratio: float, adapter):
    """infoflow's rows over the plain layout, and the same document rows in the linked one (document j moves by K
    x j): one pick for both, so the two differ only by the links. (The engine picks over the linked prompt itself.)"""
    if ratio <= 0:
        return None, None
    with torch.no_grad():
        r0 = strategy_selection(eng, plain, kv, "infoflow", ratio, exact_first=adapter is None)
    if r0 is None:
        return None, None
    r1 = r0.clone()
    for s0, s1 in zip(plain.docs, linked.docs):
        inside = (r0 >= s0.start) & (r0 < s0.end)
        r1[inside] += s1.start - s0.start
    return r0, r1


if __name__ == "__main__":
    main()

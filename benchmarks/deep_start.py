"""Does recomputing a document row only in the deep layers keep the quality? (an experiment, CPU or GPU)

Selective recompute today runs a chosen document row through every layer. The variant measured here starts it at
layer `s`, from the row's own hidden state there in its document's offline pass (the state the cached K/V of
layers >= s were projected from): below `s` every document row keeps its cached K/V and only the question rows are
computed. If the cross-document attention of the shallow layers matters little, a row costs (L - s) / L of a
full-depth row, so the same compute recomputes L / (L - s) times as many rows; and the question rows' first `s`
layers are exactly the selection probe's, so they need not run twice.

For each example: full prefill's greedy answer (the teacher), then the student's log-probs over it, teacher-forced,
for each (start, ratio) pair, all recomputing the rows infoflow selects at that ratio. Printed per variant: KL
(teacher || student) per answer token, the share of first answer tokens the student's argmax agrees on (three in
four answers that differ from full prefill's differ there), the share of all answer tokens it agrees on, and the
compute the recompute costs (ratio x (L - s) / L of the document rows' full-depth cost).

    python benchmarks/deep_start.py --data ../shared/data --datasets 2wikimqa,hotpotqa,musique --limit 20 \
        --variants 0:0.15,0:0.3,8:0.15,8:0.225,12:0.3,16:0.45

`--bands a-b,...` adds an oracle diagnosis at 15%: the rows not recomputed get full prefill's own (contextual) K/V
in layers [a, b) instead of their cached ones, so the KL left says how much of the fused path's error the stale
caches of those layers carry (0-L: every layer's, which must give KL 0 up to rounding).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from kvfuse.engine.adapter import AdaptedDecoder
from kvfuse.evaluation.data import load_examples
from kvfuse.evaluation.runner import load_engine
from kvfuse.kernels.rope import apply_rope_reference
from kvfuse.training.distill import _answer_rows, document_kv, forward_rows, strategy_selection


def _attend(dec, i, h, q_pos, ctx_k, ctx_v, ctx_pos, cos, sin, qkv=None, ctx_keep=None):
    """Layer i's attention of rows at `q_pos` over ctx + themselves (causal by position) and the layer's finish.
    `ctx_keep` [rows, ctx rows]: which ctx rows each row may see (None: all)."""
    s = dec.spec
    q, k, v = dec.project(i, h) if qkv is None else qkv
    k_all = torch.cat([ctx_k, k])
    v_all = torch.cat([ctx_v, v])
    all_pos = torch.cat([ctx_pos, q_pos])
    mask = all_pos[None, :] <= q_pos[:, None]
    if ctx_keep is not None:
        mask[:, :ctx_pos.numel()] &= ctx_keep
    qr = apply_rope_reference(q, cos[q_pos], sin[q_pos]).transpose(0, 1)
    kr = apply_rope_reference(k_all, cos[all_pos], sin[all_pos]).transpose(0, 1)
    o = F.scaled_dot_product_attention(qr, kr, v_all.transpose(0, 1), attn_mask=mask, scale=s.scale, enable_gqa=True)
    return dec.finish(i, h, o.transpose(0, 1))


def doc_hidden(engine, layout, adapter, start: int) -> list[torch.Tensor]:
    """Each document's hidden state entering layer `start` in its offline pass (alone after the prefix)."""
    dec = AdaptedDecoder(engine.decoder, adapter) if adapter is not None and adapter.stage == "offline" \
        else engine.decoder
    prefix = engine.doc_cache.prefix_kv()
    p = layout.prefix.end - layout.prefix.start
    lens = [len(x) for x in layout.doc_ids]
    cos, sin = engine.runner.rope(p + max(lens))
    dev = engine.device
    out = []
    for ids in layout.doc_ids:
        pos = torch.arange(p, p + len(ids), device=dev)
        h = dec.embed_tokens(torch.as_tensor(ids, dtype=torch.long, device=dev))
        ppos = torch.arange(p, device=dev)
        for i in range(start):
            h = _attend(dec, i, h, pos, prefix.k[i], prefix.v[i], ppos, cos, sin)
        out.append(h)
    return out


def student(engine, layout, answer, doc_kv, doc_h, recompute, start: int, mask_band=None) -> torch.Tensor:
    """log p over the answer (teacher-forced) when the rows `recompute` are computed from layer `start` on.
    `mask_band` (lo, hi): in layers lo..hi-1 the question and answer rows do not see the documents' cached (stale)
    rows, only the prefix, the recomputed rows and themselves (the recomputed rows still see everything)."""
    dec = engine.decoder
    dev = dec.device
    n_layers = dec.spec.n_layers
    a_ids, a_pos = _answer_rows(layout, answer)
    cos, sin = engine.runner.rope(layout.n + int(a_ids.numel()))
    is_doc = torch.zeros(layout.n, dtype=torch.bool)
    is_doc[layout.prefix.start:layout.prefix.end] = True
    for sp in layout.docs:
        is_doc[sp.start:sp.end] = True
    q_rows = torch.arange(layout.n)[~is_doc]
    rec = torch.zeros(layout.n, dtype=torch.bool)
    if recompute is not None and recompute.numel():
        rec[recompute] = True
    # the recomputed rows' entry state: their offline hidden state at `start` (the embedding when start is 0)
    h_rec = torch.cat([h[rec[sp.start:sp.end].to(dev)] for sp, h in zip(layout.docs, doc_h)]) \
        if rec.any() else None
    rec_pos = torch.arange(layout.n)[rec]
    prefix = engine.doc_cache.prefix_kv()

    def ctx(i: int, drop: torch.Tensor | None):
        ks, vs, ps = [prefix.k[i]], [prefix.v[i]], [torch.arange(layout.prefix.start, layout.prefix.end)]
        for sp, (k, v) in zip(layout.docs, doc_kv):
            keep = torch.ones(sp.end - sp.start, dtype=torch.bool) if drop is None else ~drop[sp.start:sp.end]
            ks.append(k[i][keep.to(dev)])
            vs.append(v[i][keep.to(dev)])
            ps.append(torch.arange(sp.start, sp.end)[keep])
        return torch.cat(ks), torch.cat(vs), torch.cat(ps).to(dev)

    stale = (is_doc & ~rec).to(dev)  # documents' cached rows (the prefix is exact, not stale)
    stale[layout.prefix.start:layout.prefix.end] = False
    pos = torch.cat([q_rows, a_pos]).to(dev)
    h = dec.embed_tokens(torch.cat([layout.ids[q_rows], a_ids]).to(dev))
    for i in range(n_layers):
        if i == start and h_rec is not None:
            h = torch.cat([h_rec, h])
            pos = torch.cat([rec_pos.to(dev), pos])
        ck, cv, cp = ctx(i, rec if i >= start else None)
        keep = None
        if mask_band is not None and mask_band[0] <= i < mask_band[1]:
            stale_col = stale[cp]
            qa_row = ~torch.isin(pos, rec_pos.to(dev))
            keep = ~(qa_row[:, None] & stale_col[None, :])
        h = _attend(dec, i, h, pos, ck, cv, cp, cos, sin, ctx_keep=keep)
    first = int((pos < layout.n - 1).sum())  # rows are sorted within each group; the last prompt row is n - 1
    order = torch.argsort(pos)
    h = h[order]
    return torch.log_softmax(dec.logits(h[first:]).float(), dim=-1)


def student_shift(engine, layout, answer, doc_kv, recompute, lo: int, hi: int, mode: str, parts: str,
                  alpha: float) -> torch.Tensor:
    """log p over the answer when the rows not recomputed are corrected in layers [lo, hi).

    At each such layer the recomputed rows' fresh K/V (projected in this pass) minus their cached K/V give a drift;
    the rows not recomputed get their cached K/V plus `alpha` x the mean drift (pre-rotation) of the recomputed rows
    of their own document (`mode` "doc"; a document with none gets none), of every document ("all"), of the
    document's rows weighted by exp(-distance / T) ("nearT"), or the document's sum over n rows / (n + C)
    ("shrinkC"), on K, V or both (`parts`: "k", "v", "kv")."""
    dec = engine.decoder
    dev = dec.device
    a_ids, a_pos = _answer_rows(layout, answer)
    cos, sin = engine.runner.rope(layout.n + int(a_ids.numel()))
    is_doc = torch.zeros(layout.n, dtype=torch.bool)
    is_doc[layout.prefix.start:layout.prefix.end] = True
    doc_of = torch.full((layout.n,), -1, dtype=torch.long)
    for d, sp in enumerate(layout.docs):
        is_doc[sp.start:sp.end] = True
        doc_of[sp.start:sp.end] = d
    q_rows = torch.arange(layout.n)[~is_doc]
    rec = torch.zeros(layout.n, dtype=torch.bool)
    if recompute is not None and recompute.numel():
        rec[recompute] = True
    rec_pos = torch.arange(layout.n)[rec]
    rec_doc = doc_of[rec_pos].to(dev)
    n_rec = int(rec_pos.numel())
    prefix = engine.doc_cache.prefix_kv()
    pos = torch.cat([rec_pos, q_rows, a_pos]).to(dev)
    h = dec.embed_tokens(torch.cat([layout.ids[rec_pos], layout.ids[q_rows], a_ids]).to(dev))
    for i in range(dec.spec.n_layers):
        q, k, v = dec.project(i, h)
        drift = {}
        if lo <= i < hi and n_rec:
            ck = torch.cat([dk[i][rec[sp.start:sp.end].to(dev)] for sp, (dk, _) in zip(layout.docs, doc_kv)])
            cv = torch.cat([dv[i][rec[sp.start:sp.end].to(dev)] for sp, (_, dv) in zip(layout.docs, doc_kv)])
            dk_all, dv_all = (k[:n_rec] - ck).float(), (v[:n_rec] - cv).float()
            for d, sp in enumerate(layout.docs):
                m = torch.ones_like(rec_doc, dtype=torch.bool) if mode == "all" else rec_doc == d
                if not m.any():
                    continue
                if mode.startswith("near"):  # weights exp(-|distance| / tau) over the document's recomputed rows
                    tau = float(mode[4:])
                    keep_pos = torch.arange(sp.start, sp.end)[~rec[sp.start:sp.end]].to(dev)
                    w = torch.softmax(-(keep_pos[:, None] - rec_pos.to(dev)[m][None, :]).abs().float() / tau, dim=1)
                    drift[d] = (alpha * (w @ dk_all[m].flatten(1)).view(-1, *dk_all.shape[1:])
                                if "k" in parts else None,
                                alpha * (w @ dv_all[m].flatten(1)).view(-1, *dv_all.shape[1:])
                                if "v" in parts else None)
                    continue
                # "shrinkC": the document's drift summed over its n recomputed rows / (n + C), toward 0 when n is small
                denom = int(m.sum()) + (float(mode[6:]) if mode.startswith("shrink") else 0.0)
                drift[d] = (alpha * dk_all[m].sum(0) / denom if "k" in parts else None,
                            alpha * dv_all[m].sum(0) / denom if "v" in parts else None)
        ks, vs, ps = [prefix.k[i]], [prefix.v[i]], [torch.arange(layout.prefix.start, layout.prefix.end)]
        for d, (sp, (dk, dv)) in enumerate(zip(layout.docs, doc_kv)):
            keep = ~rec[sp.start:sp.end]
            kk, vv = dk[i][keep.to(dev)], dv[i][keep.to(dev)]
            if d in drift:
                sk, sv = drift[d]
                kk = kk if sk is None else (kk.float() + sk).to(kk.dtype)
                vv = vv if sv is None else (vv.float() + sv).to(vv.dtype)
            ks.append(kk)
            vs.append(vv)
            ps.append(torch.arange(sp.start, sp.end)[keep])
        h = _attend(dec, i, h, pos, torch.cat(ks), torch.cat(vs), torch.cat(ps).to(dev), cos, sin, qkv=(q, k, v))
    first = int((pos < layout.n - 1).sum())
    h = h[torch.argsort(pos)]
    return torch.log_softmax(dec.logits(h[first:]).float(), dim=-1)


def with_true_kv(layout, doc_kv, full_k, full_v, lo: int, hi: int):
    """The documents' caches with layers [lo, hi) replaced by full prefill's K/V of the same rows."""
    out = []
    for sp, (ks, vs) in zip(layout.docs, doc_kv):
        out.append(([full_k[i][sp.start:sp.end] if lo <= i < hi else k for i, k in enumerate(ks)],
                    [full_v[i][sp.start:sp.end] if lo <= i < hi else v for i, v in enumerate(vs)]))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--datasets", default="2wikimqa,hotpotqa,musique")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--skip", type=int, default=0)
    ap.add_argument("--variants", default="0:0.15,0:0.3,8:0.15,8:0.225,12:0.3,16:0.45")
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--adapter", default="auto")
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--out", default=None, help="JSONL of per-example figures")
    ap.add_argument("--bands", default="", help="oracle layer bands a-b (see the module doc)")
    ap.add_argument("--mask-stale", default="", help="layer bands a-b where the question and answer rows do not "
                    "attend to the documents' stale cached rows (infoflow 15%%; see student's mask_band)")
    ap.add_argument("--shift", default="", help="drift corrections lo-hi:doc|all|nearT|shrinkC:k|v|kv:alpha, comma "
                    "separated (infoflow 15%%; see student_shift)")
    args = ap.parse_args()
    variants = [(int(a), float(b)) for a, b in (v.split(":") for v in args.variants.split(",") if v)]
    bands = [tuple(int(x) for x in b.split("-")) for b in args.bands.split(",") if b]
    shifts = [x for x in args.shift.split(",") if x]
    examples = load_examples(args.data, datasets=args.datasets.split(","), limit=args.limit, skip=args.skip)
    engine = load_engine(args.model, device=args.device, adapter=None if args.adapter == "none" else args.adapter)
    adapter = engine.adapter
    L = engine.decoder.spec.n_layers
    masks = [tuple(int(x) for x in b.split("-")) for b in args.mask_stale.split(",") if b]
    extra = [("true", b) for b in bands] + [("shift", x) for x in shifts] + [("mask", b) for b in masks]
    rows = {v: {"kl": [], "first": [], "tok": []} for v in variants + extra}
    out = open(args.out, "w") if args.out else None
    t0 = time.time()
    with torch.no_grad():
        for n, ex in enumerate(examples):
            answer = list(engine.generate(ex.question, ex.docs, strategy="full", max_new_tokens=args.answer_tokens,
                                          temperature=0.0).token_ids)
            if not answer:
                continue
            teacher = engine.next_token_logprobs(ex.question, ex.docs, answer + [0], strategy="full")
            teacher = teacher.to(engine.device).float()
            layout = engine.layout(ex.question, ex.docs)
            doc_kv = document_kv(engine, layout, adapter)
            starts = sorted({s for s, _ in variants})
            hid = {s: doc_hidden(engine, layout, adapter, s) for s in starts}
            sel = {}
            rec = {"example": ex.id, "dataset": ex.dataset, "answer": answer}
            if bands:
                cos, sin = engine.runner.rope(layout.n)
                _, full_k, full_v = forward_rows(engine.decoder, layout.ids.to(engine.device),
                                                 torch.arange(layout.n, device=engine.device), cos, sin)
                hid.setdefault(0, doc_hidden(engine, layout, adapter, 0))
            for s, r in variants + extra:
                r_sel = r if isinstance(s, int) else 0.15  # the oracle bands and the drift variants run at 15%
                if r_sel not in sel:
                    sel[r_sel] = strategy_selection(engine, layout, doc_kv, "infoflow", r_sel)
                if s == "shift":
                    rng, mode, parts, alpha = r.split(":")
                    lo, hi = (int(x) for x in rng.split("-"))
                    lp = student_shift(engine, layout, answer + [0], doc_kv, sel[r_sel], lo, hi, mode, parts,
                                       float(alpha))
                elif s == "mask":
                    lp = student(engine, layout, answer + [0], doc_kv, hid[0], sel[r_sel], 0, mask_band=r)
                elif s == "true":
                    kv = with_true_kv(layout, doc_kv, full_k, full_v, *r)
                    lp = student(engine, layout, answer + [0], kv, hid[0], sel[r_sel], 0)
                else:
                    lp = student(engine, layout, answer + [0], doc_kv, hid[s], sel[r_sel], s)
                kl = float((teacher.exp() * (teacher - lp)).sum(-1).mean())
                pred = lp.argmax(-1).cpu().tolist()
                first = float(pred[0] == answer[0])
                tok = sum(int(a == b) for a, b in zip(pred, answer)) / len(answer)
                rows[(s, r)]["kl"].append(kl)
                rows[(s, r)]["first"].append(first)
                rows[(s, r)]["tok"].append(tok)
                rec[f"{s}:{r}"] = {"kl": kl, "first": first, "tok": tok}
            if out:
                out.write(json.dumps(rec) + "\n")
                out.flush()
            print(f"[{n + 1}/{len(examples)}] {ex.id} {time.time() - t0:.0f}s", file=sys.stderr, flush=True)
    print(f"{len(rows[variants[0]]['kl'])} answers, {args.datasets}, model {args.model}, adapter {args.adapter}")
    print("| start layer | ratio | compute (share of full-depth rows) | KL | first token agrees | tokens agree |")
    print("|---:|---:|---:|---:|---:|---:|")
    for (s, r), m in rows.items():
        head = (f"| 0, drift {r} | 0.150 | 0.150" if s == "shift" else
                f"| 0, layers {r[0]}-{r[1] - 1} true K/V | 0.150 | 0.150" if s == "true" else
                f"| 0, layers {r[0]}-{r[1] - 1} question masked from stale rows | 0.150 | 0.150" if s == "mask" else
                f"| {s} | {r:.3f} | {r * (L - s) / L:.3f}")
        print(f"{head} | {statistics.mean(m['kl']):.4f} | {100 * statistics.mean(m['first']):.1f}% | "
              f"{100 * statistics.mean(m['tok']):.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

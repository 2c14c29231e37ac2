"""Where sift's block lists lose attention mass, against full prefill's own attention (issue 12; embedded model, CPU).

For each prompt, full prefill's attention (averaged over heads) is measured at every layer, and for every document
query row the mass that falls on key blocks its block list leaves out is summed, split by where those keys are:
its own document, earlier documents, or glue rows (titles). Beside it, at the same count of blocks per query block:
- an oracle: each query block keeps the blocks of highest mass for its rows;
- the best static cross set: per earlier document one set of blocks for every later row (what an index can hold),
  those that receive the most mass from later documents, as many as its cross marks;
- a whole-row pick from block-mean queries and keys (no index at all).
A large gap between the plan and the oracle says the plan opens the wrong blocks; the static set says how much of
that gap any per-document index could close.
Per head, the mass each head's rows lose to their list (the head losing most and least, per layer): with one list
for all heads it says how much lists per KV head could gain; `sift:...:heads=kv` measures them.

    python benchmarks/sift_mass.py --data ../shared/data --datasets musique,musique_cacheblend --limit 3 \
        --spec sift --spec sift:cross=pick --spec sift:local=pick --spec sift:local=pick:heads=kv
"""
from __future__ import annotations

import argparse
import statistics as st

import torch

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.prompt import PROMPT_PRESETS
from kvfuse.evaluation.data import read_jsonl, select_examples
from kvfuse.kernels.rope import apply_rope


def block_masks(lists, counts, nb: int) -> torch.Tensor:
    """[L, NB, NB] bool from the plan's per-layer key-block lists."""
    out = torch.zeros(len(lists), nb, nb, dtype=torch.bool)
    for i, (ls, c) in enumerate(zip(lists, counts)):
        ls, c = ls.cpu().long(), c.cpu().long()
        keep = torch.arange(ls.shape[1])[None, :] < c[:, None]
        rows = torch.arange(nb)[:, None].expand_as(ls)
        out[i, rows[keep], ls[keep]] = True
    return out


@torch.inference_mode()
def measure(eng: FusionEngine, layout, plan, block: int, chunk: int = 512) -> list[dict]:
    """`plan`: the request's (lists, counts) as `sparse_plan` gives them (a static plan or a `CrossPick`)."""
    dec, spec = eng.decoder, eng.decoder.spec
    ids = layout.ids.to(dec.device)
    n = int(ids.numel())
    nb = -(-n // block)
    cos, sin = eng.runner.rope(n)
    owner = torch.full((nb,), -1, dtype=torch.long)  # key block -> document index (-1: prefix / glue / tail)
    for j, sp in enumerate(layout.docs):
        owner[sp.start // block:(sp.end - 1) // block + 1] = j
    prefix_blocks = layout.docs[0].start // block if layout.docs else 0
    first_blk = torch.zeros(nb, dtype=torch.bool)  # a document's first / last key block
    last_blk = torch.zeros(nb, dtype=torch.bool)
    for sp in layout.docs:
        first_blk[sp.start // block] = True
        last_blk[(sp.end - 1) // block] = True
    doc_rows = torch.cat([torch.arange(sp.start, sp.end) for sp in layout.docs])
    row_doc = torch.cat([torch.full((sp.end - sp.start,), j) for j, sp in enumerate(layout.docs)])
    group = spec.n_heads // spec.n_kv_heads
    h = dec.embed_tokens(ids)
    per_layer = []
    for i in range(spec.n_layers):
        q, k, v = dec.project(i, h)
        qr = apply_rope(q, cos[:n], sin[:n]).float()
        kr = apply_rope(k, cos[:n], sin[:n]).float().repeat_interleave(group, dim=1)
        vf = v.float().repeat_interleave(group, dim=1)
        outs = []
        bmass = torch.zeros(n, nb)  # [row, key block] head-averaged attention
        hmass = torch.zeros(qr.shape[1], n, nb)  # [head, row, key block]
        for a in range(0, n, chunk):
            b = min(n, a + chunk)
            s = torch.einsum("thd,khd->htk", qr[a:b], kr) * spec.scale
            s = s.masked_fill(torch.arange(n)[None, None, :] > torch.arange(a, b)[None, :, None], float("-inf"))
            pr = torch.softmax(s, dim=-1)
            outs.append(torch.einsum("htk,khd->thd", pr, vf).to(q.dtype))
            hmass[:, a:b] = torch.zeros(pr.shape[0], b - a, nb).index_add_(2, torch.arange(n) // block, pr)
            bmass[a:b] = hmass[:, a:b].mean(0)
        h = dec.finish(i, h, torch.cat(outs))
        lists, counts = plan[0].layer(i, qr.to(q.dtype), apply_rope(k, cos[:n], sin[:n]))
        if lists.dim() == 3:  # lists per KV head: each q head reads its KV head's
            mh = torch.stack([block_masks([ls], [c], nb)[0] for ls, c in zip(lists, counts)])
            mh = mh.repeat_interleave(qr.shape[1] // mh.shape[0], 0)
        else:
            mh = block_masks([lists], [counts], nb)[0][None].expand(qr.shape[1], -1, -1)  # [H, NB, NB]
        m = mh[0]  # the counts per query block (the same for every head)
        rm = bmass[doc_rows]  # [R, NB]
        qb = doc_rows // block
        keep_h = mh[:, qb]  # [H, R, NB] each head's row's list
        keep = keep_h.all(0)  # what every head keeps (with one shared list: the list)
        dropped = (hmass[:, doc_rows] * (~keep_h)).mean(0)  # head-averaged mass off each row's lists
        own = owner[None, :] == row_doc[:, None]
        earlier = (owner[None, :] >= 0) & (owner[None, :] < row_doc[:, None])
        glue = (owner[None, :] < 0) & (torch.arange(nb)[None, :] >= prefix_blocks)
        # the oracle: each query block keeps its `count` blocks of highest summed mass over its rows
        qmass = torch.zeros(nb, nb).index_add_(0, qb, rm)
        cnt = m.sum(1)
        top = torch.argsort(qmass, dim=1, descending=True)
        oracle = torch.zeros(nb, nb, dtype=torch.bool)
        ranks = torch.arange(nb)[None, :] < cnt[:, None]
        oracle.scatter_(1, top, ranks)
        dropped_oracle = rm * (~oracle[qb])
        # the best static cross set: per earlier document, as many blocks as its cross marks keep for the last
        # document's rows, those that receive the most mass from all later documents' rows (one set for them all)
        static = torch.zeros(nb, dtype=torch.bool)
        tail_blk = (layout.docs[-1].end - 1) // block  # from here on rows see everything (a tail row shares it)
        for j, sp in enumerate(layout.docs[:-1]):
            blks = (owner == j).nonzero().flatten()
            # a later document's query block two or more blocks past doc j: its list holds doc j's cross marks alone
            ref = [b for b in range(blks[-1].item() + 2, tail_blk) if owner[b] > j]
            if not ref:
                static[blks] = m[tail_blk - 1 if tail_blk > 0 else 0, blks]
                continue
            c = int(m[ref[0], blks].sum())
            later = row_doc > j
            got = rm[later][:, blks].sum(0)
            static[blks] = False
            static[blks[torch.argsort(got, descending=True)[:c]]] = True
        near = (qb[:, None] - torch.arange(nb)[None, :]) <= 1  # the local window (a block and the one before)
        static_keep = torch.where(earlier, static[None, :] | (keep & near), keep)
        dropped_static = rm * (~static_keep) * earlier
        # a query-dependent estimate at the same count: block-mean queries against block-mean keys (per head,
        # softmax over the causal blocks, averaged over heads), as dynamic block-sparse prefill methods pick blocks
        bq = torch.zeros(nb, qr.shape[1], qr.shape[2]).index_add_(0, torch.arange(n) // block, qr)
        bk = torch.zeros(nb, kr.shape[1], kr.shape[2]).index_add_(0, torch.arange(n) // block, kr)
        sizes = torch.bincount(torch.arange(n) // block, minlength=nb).clamp_min(1)[:, None, None]
        est = torch.einsum("qhd,khd->hqk", bq / sizes, bk / sizes) * spec.scale
        est = torch.softmax(est.masked_fill(~torch.tril(torch.ones(nb, nb, dtype=torch.bool)), float("-inf")), -1)
        est = est.mean(0)
        pooled = torch.zeros(nb, nb, dtype=torch.bool)
        pooled.scatter_(1, torch.argsort(est, dim=1, descending=True), ranks)
        dropped_pooled = rm * (~pooled[qb])
        per_head = (hmass[:, doc_rows] * (~keep_h)).sum(2).mean(1)  # [H] mass each head's rows lose
        per_layer.append({
            "head_max": float(per_head.max()),
            "head_min": float(per_head.min()),
            "pooled": float(dropped_pooled.sum(1).mean()),
            "static": float(dropped_static.sum(1).mean()),
            "dropped": float(dropped.sum(1).mean()),
            "own": float((dropped * own).sum(1).mean()),
            "earlier": float((dropped * earlier).sum(1).mean()),
            "glue": float((dropped * glue).sum(1).mean()),
            "oracle": float(dropped_oracle.sum(1).mean()),
            "prev_doc": float((dropped * (owner[None, :] == row_doc[:, None] - 1)).sum(1).mean()),
            "first_blk": float((dropped * (earlier & first_blk[None, :])).sum(1).mean()),
            "last_blk": float((dropped * (earlier & last_blk[None, :])).sum(1).mean()),
            "to_earlier": float((rm * earlier).sum(1).mean()),
            "density": float(keep_h.float().mean()),
        })
    return per_layer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", required=True)
    ap.add_argument("--datasets", default="musique_cacheblend")
    ap.add_argument("--limit", type=int, default=3)
    ap.add_argument("--spec", action="append", help="sift specs (default: sift)")
    args = ap.parse_args()
    eng = FusionEngine.from_pretrained(device="cpu", disk_cache=False, adapter=None, prompt=PROMPT_PRESETS["qa"])
    specs = args.spec or ["sift"]
    for ds in args.datasets.split(","):
        exs = select_examples(read_jsonl(args.data), datasets=[ds], limit=args.limit, seed=0)
        for spec in specs:
            rows = []
            for e in exs:
                strat = make_strategy(spec, on_miss="compute", min_tokens=0, max_density=1.0)
                layout = eng.layout(e.question, e.docs)
                (lists, counts, block), rep = eng._sift_plan(layout, strat)
                rows.append(measure(eng, layout, (lists, counts), block))
            L = len(rows[0])
            print(f"\n{ds}, {spec}, {len(exs)} prompts: attention mass a document row loses per layer (mean over rows)")
            print("layer | to earlier docs | dropped | own doc | earlier docs | glue | oracle at the same count | "
                  "density")
            for i in range(L):
                g = {k: st.mean(r[i][k] for r in rows) for k in rows[0][i]}
                print(f"{i:5d} | {g['to_earlier']:.3f} | {g['dropped']:.3f} | {g['own']:.3f} | {g['earlier']:.3f} | "
                      f"{g['glue']:.3f} | {g['oracle']:.3f} | {g['density']:.3f}")
            avg = {k: st.mean(r[i][k] for r in rows for i in range(L)) for k in rows[0][0]}
            print(f"  all | {avg['to_earlier']:.3f} | {avg['dropped']:.3f} | {avg['own']:.3f} | {avg['earlier']:.3f} | "
                  f"{avg['glue']:.3f} | {avg['oracle']:.3f} | {avg['density']:.3f}")
            print(f"  of the mass dropped on earlier documents: {avg['prev_doc']:.3f} on the document just before, "
                  f"{avg['first_blk']:.3f} on documents' first blocks, {avg['last_blk']:.3f} on their last blocks; "
                  f"the best static cross set of the same size would drop {avg['static']:.3f} there. A query-dependent "
                  f"pick at the same count from block-mean queries and keys drops {avg['pooled']:.3f} in all "
                  f"(the oracle {avg['oracle']:.3f}, this plan {avg['dropped']:.3f}). Per head (off its own list): "
                  f"the head losing most drops {avg['head_max']:.3f}, the one losing least {avg['head_min']:.3f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

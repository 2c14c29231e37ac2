"""Bytes of a sift index against the K/V cache it replaces, per document.

    python benchmarks/sift_storage.py                     # the Llama-3.1-8B shape (index size needs no weights)
    python benchmarks/sift_storage.py --model qwen2.5-coder-0.5b --data ../shared/data --docs 40
        # also real indexes of dev passages on that model: bytes and attention density

An index is bit sets (per layer: the lower triangle of a block x block matrix, and one bit per block) plus a
fixed header, so its size depends only on the document's length, the block and the layer count.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from kvfuse.engine.sift import SiftIndex

SHAPES = {"llama8b": dict(n_layers=32, n_kv_heads=8, head_dim=128)}


def kv_bytes(n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, elem: int = 2) -> int:
    return 2 * n_layers * n_kv_heads * head_dim * elem * n_tokens


def index_bytes(n_tokens: int, n_layers: int, block: int) -> int:
    nb = -(-n_tokens // block)
    idx = SiftIndex(block, n_tokens, torch.zeros(n_layers, nb, nb, dtype=torch.bool),
                    torch.zeros(n_layers, nb, dtype=torch.bool))
    return len(idx.to_bytes("0" * 64))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--model", default=None)
    ap.add_argument("--data", default=None)
    ap.add_argument("--docs", type=int, default=40)
    ap.add_argument("--prompts", type=int, default=0, help="also the attention density of this many eval prompts "
                                                           "(the first of each dataset in `kvfuse eval`'s order)")
    ap.add_argument("--datasets", default="2wikimqa,hotpotqa")
    a = ap.parse_args()
    print("| shape | document tokens | index bytes | K/V bytes (bf16) | K/V / index |")
    print("|---|---:|---:|---:|---:|")
    for name, s in SHAPES.items():
        for n in (256, 512, 1024, 4096):
            ib, kb = index_bytes(n, s["n_layers"], a.block), kv_bytes(n, **s)
            print(f"| {name} | {n} | {ib:,} | {kb:,} | {kb / ib:,.0f}x |")
    if a.model and a.data:
        from kvfuse.engine.api import FusionEngine
        from kvfuse.engine.fusion import make_strategy
        from kvfuse.evaluation.data import read_jsonl

        from kvfuse.engine.prompt import PROMPT_PRESETS

        eng = FusionEngine.from_pretrained(a.model, device="cpu", disk_cache=False, adapter=None,
                                           prompt=PROMPT_PRESETS["qa"])  # the eval's prompt
        strat = make_strategy("sift", block=a.block, min_tokens=0, max_density=1.0, on_miss="compute")
        seen, rows = set(), []
        from kvfuse.engine.types import as_documents

        for ex in read_jsonl(a.data):
            for doc in as_documents(ex.docs):
                if doc.id in seen or len(rows) >= a.docs:
                    continue
                seen.add(doc.id)
                ids = eng.prompts.encode_document(doc)
                idx, _ = eng._sift_index(ids, strat)
                spec = eng.decoder.spec
                rows.append((len(ids), len(idx.to_bytes(eng._sift_key(ids, strat))),
                             kv_bytes(len(ids), spec.n_layers, spec.n_kv_heads, spec.head_dim), idx.density()))
            if len(rows) >= a.docs:
                break
        if a.prompts:
            from kvfuse.evaluation.data import select_examples

            for name in a.datasets.split(","):
                dens = []
                for ex in select_examples(read_jsonl(a.data), datasets=[name], limit=a.prompts, seed=0):
                    layout = eng.layout(ex.question, ex.docs)
                    _, rep = eng._sift_plan(layout, strat)
                    dens.append((layout.n, rep["density"]))
                print(f"{name}: {len(dens)} prompts, median {statistics.median(d[0] for d in dens):.0f} tokens, "
                      f"attention density (kernel blocks of 16) mean {statistics.mean(d[1] for d in dens):.3f}, "
                      f"min {min(d[1] for d in dens):.3f}")
        med = lambda i: statistics.median(r[i] for r in rows)  # noqa: E731
        print(f"\n{eng.model_name}, {len(rows)} dev passages: median {med(0):.0f} tokens, index {med(1):,.0f} B, "
              f"K/V {med(2):,.0f} B ({med(2) / med(1):,.0f}x), local density {med(3):.2f} "
              f"(share of causal block pairs kept)")


if __name__ == "__main__":
    main()

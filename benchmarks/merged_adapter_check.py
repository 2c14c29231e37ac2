"""Does computing the shipped offline adapter's documents on merged bf16 weights (the engine's way) change answers
against the adapter as trained (LoRA pairs beside each projection)?

Two engines of the embedded model, one computing documents on merged weights, one on the unmerged adapter, no disk
cache (so neither reads the other's caches). Per example (the eval harness's seeded order, the first `--limit` of each
set): the first answer token's log-probabilities of full prefill and of infoflow at 15% on each engine; printed per set:
how often each picks full's first token, how often the two pick the same one, and KL(full || fused) at that token.
Also printed: the merged weights' rounding of the adapter's delta (layer 0) and the distance of four hotpotqa
passages' K/V, merged against unmerged, beside the adapter's own effect and beside another pass arrangement.

    python benchmarks/merged_adapter_check.py --data ../shared/data --limit 20 --out docs/quality/merged_adapter/first_token.jsonl
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--data", default="../shared/data")
    ap.add_argument("--datasets", default="2wikimqa,hotpotqa,musique")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()

    from kvfuse import FusionEngine
    from kvfuse.engine.adapter import AdaptedDecoder
    from kvfuse.engine.prompt import PROMPT_PRESETS
    from kvfuse.engine.runner import Runner
    from kvfuse.evaluation.data import load_examples

    def engine():
        return FusionEngine.from_pretrained("qwen2.5-coder-0.5b", device="cpu", disk_cache=False,
                                            prompt=PROMPT_PRESETS["qa"], cold_documents="compute")

    merged, lora = engine(), engine()
    lora.doc_cache.doc_runner = Runner(AdaptedDecoder(lora.decoder, lora.adapter), cuda_graphs=False)
    done = set()
    if args.out.exists():
        done = {json.loads(line)["id"] for line in args.out.open(encoding="utf-8")}
    with args.out.open("a", encoding="utf-8") as out:
        for ds in args.datasets.split(","):
            for ex in load_examples(args.data, datasets=[ds], limit=args.limit):
                if ex.id in done:
                    continue
                full = merged.next_token_logprobs(ex.question, ex.docs, [0], strategy="full")[0]
                a = merged.next_token_logprobs(ex.question, ex.docs, [0], strategy="infoflow", recompute_ratio=0.15)[0]
                b = lora.next_token_logprobs(ex.question, ex.docs, [0], strategy="infoflow", recompute_ratio=0.15)[0]
                p = full.exp()
                out.write(json.dumps({"id": ex.id, "ds": ds, "full": int(full.argmax()), "merged": int(a.argmax()),
                                      "lora": int(b.argmax()), "kl_merged": float((p * (full - a)).sum()),
                                      "kl_lora": float((p * (full - b)).sum())}) + "\n")
                out.flush()
    _rounding(merged, load_examples(args.data, datasets=["hotpotqa"], limit=1)[0])
    rows = [json.loads(line) for line in args.out.open(encoding="utf-8")]
    print("| set | n | first token = full's: merged / unmerged | merged = unmerged | KL merged / unmerged |")
    print("|---|---:|---:|---:|---:|")
    for ds in [*args.datasets.split(","), "all"]:
        s = [r for r in rows if ds == "all" or r["ds"] == ds]
        if s:
            n = len(s)
            print(f"| {ds} | {n} | {sum(r['merged'] == r['full'] for r in s)} / {sum(r['lora'] == r['full'] for r in s)}"
                  f" | {sum(r['merged'] == r['lora'] for r in s)} | {sum(r['kl_merged'] for r in s) / n:.4f} / "
                  f"{sum(r['kl_lora'] for r in s) / n:.4f} |")


def _rounding(engine, example) -> None:
    """What bf16 keeps of the adapter's delta in the merged weights (layer 0), and how far the merged documents' K/V
    sit from the unmerged adapter's, against the adapter's own effect and against another pass arrangement."""
    import torch

    from kvfuse.engine.adapter import AdaptedDecoder
    from kvfuse.engine.docpass import documents_pass
    from kvfuse.engine.types import Document

    ad, base, merged = engine.adapter, engine.decoder.layers[0], engine.doc_cache.doc_runner.dec.layers[0]
    for t, name in (("q", "wq"), ("down", "w_down")):
        delta = ad.scale * (ad.B[t][0].float() @ ad.A[t][0].float())
        kept = getattr(merged, name).float() - getattr(base, name).float()
        print(f"layer 0 {t}: merged delta's relative error {float((kept - delta).norm() / delta.norm()):.3f}")
    dc = engine.doc_cache
    ids = [engine.prompts.encode_document(Document(p[0], p[2])) for p in example.passages[:4]]
    seam = (dc.doc_runner.rope, dc.prefix_kv(), ids)
    with torch.inference_mode():
        m = documents_pass(dc.doc_runner.dec, *seam, batched=False)
        lo = documents_pass(AdaptedDecoder(engine.decoder, ad), *seam, batched=False)
        b = documents_pass(engine.decoder, *seam, batched=False)
        b1 = documents_pass(engine.decoder, *seam, batched=False, max_tokens=1)

    def dist(x, y, f):
        return float(sum((f(u).float() - f(v).float()).norm() ** 2 for u, v in zip(x, y, strict=True)) ** 0.5)
    for part, f in (("K", lambda kv: kv.k), ("V", lambda kv: kv.v)):
        print(f"{part}: merged vs unmerged {dist(m, lo, f):.1f}, the adapter's effect {dist(lo, b, f):.1f}, "
              f"one pass vs one per document (base model) {dist(b, b1, f):.1f}")


if __name__ == "__main__":
    main()

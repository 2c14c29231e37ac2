"""Requests whose documents have no cache yet (a RAG request's first sight of them): the documents computed one
prefill each against one documents pass (engine/docpass.py), side by side in one run.

Every timed request brings new random documents (128-1024 tokens, as benchmarks/ttft.py's first-sight layouts), so
each is computed before the fused prefill (`cold_documents="compute"`, the default). Printed per row: HF SDPA full
prefill of the same prompt, kvfuse `full`, the strategy cold with one document per pass (`document_pass_tokens=0`),
with one pass (one GEMM per weight) and with one pass in GEMMs of `--chunk-rows` rows (`document_chunk_rows`: a cache
the same bits whatever its pass-mates), and `precompute` of the same documents each way; ratios against HF and
against one per pass.

    python benchmarks/cold_documents.py --shapes qwen05b,llama8b --contexts 2048,8192 --strategies infoflow,cacheblend
    python benchmarks/cold_documents.py --device cpu --shapes qwen05b --contexts 2048   # slow, ratios only

`--real FILE` instead: the embedded model's real weights on a dev set's examples (their passages as the new
documents): each example's documents computed one per pass and in one pass (on the CPU in GEMMs of 256 rows, the
engine's pass-mate-invariant form, and beside it one GEMM per weight), beside a full prefill of its prompt, and (with
the shipped offline adapter) in one pass through the adapter unmerged (training's form, the engine's before it merged
the weights for its documents); and their sift indexes (engine/sift.py `compute_indexes`) one per pass and in one.

    python benchmarks/cold_documents.py --device cpu --real ../shared/data/hotpotqa.migres.jsonl --examples 5
"""
from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from ttft import build, hf_prefill, make_engine, random_layout, time_call  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="qwen05b,llama8b")
    ap.add_argument("--contexts", default="2048,8192")
    ap.add_argument("--strategies", default="infoflow,cacheblend")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--real", default=None, help="a dev JSONL file: real weights, its examples' passages")
    ap.add_argument("--examples", type=int, default=5)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="with --real: a registry name, GGUF or HF folder")
    ap.add_argument("--chunk-rows", type=int, default=None,
                    help="rows of each GEMM of the third engine's pass (EngineConfig.document_chunk_rows; "
                         "default 256 on the CPU, 512 on CUDA; 0: no third engine)")
    args = ap.parse_args()
    if args.chunk_rows is None:
        args.chunk_rows = 256 if args.device == "cpu" else 512
    if args.real:
        return real(args)
    print({"torch": torch.__version__, "device": args.device,
           "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None}, flush=True)
    seeds = itertools.count(1)
    for shape in args.shapes.split(","):
        model = build(shape, args.device)
        vocab = model.config.vocab_size
        for ctx in (int(c) for c in args.contexts.split(",")):
            chunked = f"one pass, {args.chunk_rows}-row GEMMs"
            engines = {name: make_engine(model, "pool", pool_tokens=4 * ctx, scratch=ctx + 64,
                                         document_pass_tokens=pass_tokens, document_chunk_rows=rows)
                       for name, pass_tokens, rows in (("one per pass", 0, 0), ("one pass", 8192, 0),
                                                       (chunked, 8192, args.chunk_rows))
                       if name != chunked or args.chunk_rows > 0}
            ref = engines["one pass"]

            def hf():
                q, docs = random_layout(ref, ctx, 64, vocab, next(seeds))
                ids = [*ref.prompts.prefix_ids, *[t for d in docs for t in d.token_ids], *q]
                return hf_prefill(model, torch.tensor([ids], device=args.device))

            def cold(engine, strategy):
                def call():
                    q, docs = random_layout(engine, ctx, 64, vocab, next(seeds))
                    _sync(args.device)
                    t0 = time.perf_counter()
                    engine.generate(question_ids=q, docs=docs, strategy=strategy, recompute_ratio=args.ratio,
                                    max_new_tokens=1)
                    return time.perf_counter() - t0
                return call

            def precompute(engine):
                def call():
                    _, docs = random_layout(engine, ctx, 64, vocab, next(seeds))
                    _sync(args.device)
                    t0 = time.perf_counter()
                    engine.precompute(docs)
                    _sync(args.device)
                    return time.perf_counter() - t0
                return call

            t_hf = time_call(hf, args.reps, args.warmup)[0]
            print(f"{shape:8s} {ctx:6d}  HF SDPA full{'':32s}{t_hf * 1e3:9.2f} ms", flush=True)
            t_full = time_call(cold(ref, "full"), args.reps, args.warmup)[0]
            print(f"{shape:8s} {ctx:6d}  kvfuse full{'':33s}{t_full * 1e3:9.2f} ms  x{t_hf / t_full:5.2f} vs HF",
                  flush=True)
            rows = [(f"{s} {args.ratio:g}, cold", lambda e, s=s: cold(e, s)) for s in args.strategies.split(",")]
            rows.append(("precompute", precompute))
            for label, make in rows:
                t = {name: time_call(make(e), args.reps, args.warmup)[0] for name, e in engines.items()}
                a, b = t["one per pass"], t["one pass"]
                line = (f"{shape:8s} {ctx:6d}  {label:28s} one per pass {a * 1e3:9.2f} ms  one pass {b * 1e3:9.2f} ms"
                        f"  x{a / b:5.2f} faster  (vs HF: x{t_hf / a:5.2f} -> x{t_hf / b:5.2f})")
                if chunked in t:
                    c = t[chunked]
                    line += (f"  {chunked} {c * 1e3:9.2f} ms (x{a / c:5.2f} faster than one per pass, x{t_hf / c:5.2f}"
                             f" vs HF)")
                print(line, flush=True)
            for e in engines.values():
                e.close()
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
    return 0


def real(args) -> int:
    """The embedded model on real passages: documents one per pass against one pass, and a full prefill."""
    import json

    from kvfuse import FusionEngine
    from kvfuse.engine.adapter import AdaptedDecoder
    from kvfuse.engine.doccache import DOCUMENT_CHUNK_ROWS
    from kvfuse.engine.docpass import documents_pass
    from kvfuse.engine.sift import compute_indexes
    from kvfuse.engine.types import Document

    engine = FusionEngine.from_pretrained(args.model, device=args.device, disk_cache=False)
    dc = engine.doc_cache
    rows = [json.loads(line) for line in open(args.real, encoding="utf-8")][:args.examples + 1]
    chunk = DOCUMENT_CHUNK_ROWS if args.device == "cpu" else None  # what the engine runs a pass with here
    passes = [("one per pass", dc.doc_runner.dec, 0, None), ("one pass", dc.doc_runner.dec, 8192, chunk)]
    if chunk:
        passes.append(("one pass, one GEMM", dc.doc_runner.dec, 8192, None))
    if engine.adapter is not None and engine.adapter.stage == "offline":  # the engine runs it merged; unmerged beside
        passes.append(("one pass, adapter unmerged", AdaptedDecoder(engine.decoder, engine.adapter), 8192, chunk))
    print({"torch": torch.__version__, "device": args.device, "data": args.real}, flush=True)
    for n, row in enumerate(rows):
        docs = [(p["id"], p["title"] + "\n" + p["text"]) for p in row["passages"]]
        ids = [engine.prompts.encode_document(Document(*d)) for d in docs]
        times = {}
        for label, dec, tokens, rows in passes:
            def call(dec=dec, tokens=tokens, rows=rows):
                _sync(args.device)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    documents_pass(dec, dc.doc_runner.rope, dc.prefix_kv(), ids, max_tokens=tokens or 1, chunk=rows)
                _sync(args.device)
                return time.perf_counter() - t0
            times[label] = time_call(call, 1, 0 if n else 1)[0]

        for label, tokens in (("sift one per pass", 0), ("sift one pass", 8192)):  # the documents' sift indexes
            def index(tokens=tokens):
                _sync(args.device)
                t0 = time.perf_counter()
                compute_indexes(engine, ids, max_tokens=tokens)
                _sync(args.device)
                return time.perf_counter() - t0
            times[label] = time_call(index, 1, 0 if n else 1)[0]

        def full():
            t0 = time.perf_counter()
            engine.generate(row["question"], docs, strategy="full", max_new_tokens=1)
            return time.perf_counter() - t0
        times["full prefill"] = time_call(full, 1, 0 if n else 1)[0]
        if n == 0:
            continue  # the first example warms up
        a, b, f = times["one per pass"], times["one pass"], times["full prefill"]
        line = (f"{row['id'][:40]:40s} {len(ids):3d} docs {sum(map(len, ids)):5d} tokens  full prefill {f * 1e3:8.1f} ms"
                f"  documents: one per pass {a * 1e3:8.1f} ms ({a / f:4.2f}x full)  one pass {b * 1e3:8.1f} ms"
                f" ({b / f:4.2f}x full)  x{a / b:4.2f} faster")
        if "one pass, one GEMM" in times:
            w = times["one pass, one GEMM"]
            line += f"  (one GEMM per weight instead of {chunk}-row chunks: {w * 1e3:8.1f} ms, {w / f:4.2f}x full)"
        if "one pass, adapter unmerged" in times:
            u = times["one pass, adapter unmerged"]
            line += f"  unmerged adapter {u * 1e3:8.1f} ms ({u / f:4.2f}x full; merged x{u / b:4.2f} faster)"
        si, sp = times["sift one per pass"], times["sift one pass"]
        line += f"  sift indexes: one per pass {si * 1e3:8.1f} ms  one pass {sp * 1e3:8.1f} ms (x{si / sp:4.2f} faster)"
        print(line, flush=True)
    engine.close()
    return 0


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


if __name__ == "__main__":
    sys.exit(main())

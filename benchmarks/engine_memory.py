"""GPU memory an engine holds over first-sight requests, and what closing it gives back.

For each context length: one HF forward (as the TTFT benchmark runs beside kvfuse), then an engine made as
`benchmarks/ttft.py` makes it (document pool of n + 1024 rows, scratch n + 64) but with the engine's default decode
rows, a few first-sight requests per
strategy (new random layouts, documents precomputed first), then `close()`. After every step: memory allocated,
reserved and the peak, and the bucket graphs held (count, static-output bytes, replays/captures/eager runs).

    python benchmarks/engine_memory.py --shape llama8b --contexts 8192,32768
"""
from __future__ import annotations

import argparse
import gc

import torch

from ttft import build, make_engine, random_layout

GIB = 2 ** 30


def report(tag: str, engine=None) -> None:
    torch.cuda.synchronize()
    extra = ""
    lg = engine.runner.layout if engine is not None else None
    if lg is not None:
        extra = (f"  graphs {len(lg.entries)} static {sum(lg.sizes.values()) / GIB:.2f} GiB "
                 f"r/c/e {lg.replays}/{lg.captures}/{lg.eager_runs}")
    print(f"{tag:32s} allocated {torch.cuda.memory_allocated() / GIB:6.2f}  reserved "
          f"{torch.cuda.memory_reserved() / GIB:6.2f}  peak {torch.cuda.max_memory_allocated() / GIB:6.2f} GiB{extra}",
          flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--contexts", default="8192,32768")
    ap.add_argument("--strategies", default="full,infoflow,epic")
    ap.add_argument("--requests", type=int, default=4, help="first-sight requests per strategy")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    model = build(args.shape, "cuda")
    vocab = model.config.vocab_size
    report("model")
    seed = 0
    for n in (int(x) for x in args.contexts.split(",")):
        ids = torch.randint(100, vocab - 100, (1, n), device="cuda")
        with torch.no_grad():
            model(ids, logits_to_keep=1, use_cache=False)
        del ids
        report(f"n={n} after HF")
        # decode_tokens 0: the engine's own default decode rows (ttft.make_engine keeps one request's only)
        engine = make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64, decode_tokens=0)
        report(f"n={n} engine made", engine)
        for name in args.strategies.split(","):
            for i in range(args.requests):
                seed += 1
                q, docs = random_layout(engine, n, 64, vocab, seed)
                engine.precompute(docs)
                engine.generate(question_ids=q, docs=docs, strategy=name, max_new_tokens=1)
                report(f"n={n} {name} #{i}", engine)
        engine.close()
        del engine
        gc.collect()
        torch.cuda.empty_cache()
        report(f"n={n} closed")


if __name__ == "__main__":
    main()

"""The decoder's residual adds in the GEMM epilogue (`addmm` with beta 1) against the shipped separate add kernel
(`linear_add`: `h + F.linear(x, w)`), side by side in one run, with Hugging Face SDPA full prefill beside them.

Two engines over the same random-weight model, one per variant; every timed request is a new random layout (as
ttft.py's first-sight rows), sent to both engines in turn, the variant set while each one runs (CUDA graphs
captured by an engine keep the kernels of its variant). Prints TTFT medians and the ratios.

    python benchmarks/residual_epilogue.py --shapes qwen05b,llama8b --contexts 8192,32768 --strategies full,infoflow
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))
sys.path.append(str(Path(__file__).resolve().parent))

from ttft import build, hf_prefill, make_engine, random_layout, time_call  # noqa: E402


def epilogue_add(h, x, w, b=None):
    """The add in the GEMM's epilogue: cuBLAS adds the product to `h` and rounds once (no bias: the decoders'
    o and down projections have none)."""
    if b is None and h.dim() == 2 and x.dim() == 2:
        return torch.addmm(h, x, w.t())
    return h + torch.nn.functional.linear(x, w, b)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="qwen05b")
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--strategies", default="full")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    dev = args.device

    for shape in args.shapes.split(","):
        model = build(shape, dev)
        vocab = model.config.vocab_size
        window = model.config.max_position_embeddings
        for n in (int(c) for c in args.contexts.split(",")):
            n = min(n, window - 8)
            ids = torch.randint(100, vocab - 100, (1, n), device=dev)
            hf_ms = time_call(lambda: hf_prefill(model, ids), args.reps, args.warmup)[0] * 1e3
            print(f"{shape} {n:6d}  HF SDPA full {hf_ms:8.2f} ms", flush=True)
            engines = {v: make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64)
                       for v in ("epilogue", "separate")}
            module = next(sys.modules[c.__module__] for c in type(engines["epilogue"].decoder).__mro__
                          if hasattr(sys.modules[c.__module__], "linear_add"))
            impl = {"epilogue": epilogue_add, "separate": module.linear_add}
            for name in args.strategies.split(","):
                times = {v: [] for v in engines}
                for k in range(args.warmup + args.reps):
                    q, docs = random_layout(engines["epilogue"], n, 64, vocab, seed=k)
                    for v, eng in engines.items():
                        eng.precompute(docs)
                        module.linear_add = impl[v]
                        r = eng.generate(question_ids=q, docs=docs, strategy=name, recompute_ratio=args.ratio,
                                         max_new_tokens=1)
                        if k >= args.warmup:
                            times[v].append(r.ttft_s)
                module.linear_add = impl["separate"]
                med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
                print(f"{shape} {n:6d}  {name:10s} epilogue {med['epilogue']:8.2f} ms (HF/kvfuse "
                      f"{hf_ms / med['epilogue']:.3f}x)  separate add {med['separate']:8.2f} ms "
                      f"({hf_ms / med['separate']:.3f}x)  separate/epilogue {med['separate'] / med['epilogue']:.3f}",
                      flush=True)
            del engines
            if dev == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Two variants of one engine path, side by side in one run: TTFT of each on the same new random layouts, with
Hugging Face SDPA full prefill beside them.

Two engines over the same random-weight model, one per variant; every timed request is a new random layout (as
ttft.py's first-sight rows), sent to both engines in turn, the variant set while each one runs (CUDA graphs
captured by an engine keep the kernels of its variant). Prints TTFT medians and the ratios.

Variants (`--variant`):
- positions: key positions computed from indices in the attention kernels (kv_pos None, the shipped path) vs read
  from a materialised 0..N-1 and searched in every program (the Triton launchers wrapped here to materialise
  it, as the kernels' callers did before).
- epilogue: the decoder's residual adds in the GEMM epilogue (`addmm` with beta 1) vs the shipped separate add
  (`linear_add`: `h + F.linear(x, w)`).
- stats: the question probe's scores normalised by its attention kernel's softmax statistics
  (`kvfuse.kernels.attention_and_scores`, shipped) vs the attention and the scores as two calls (the scores then
  run a statistics pass of their own over every key).

    python benchmarks/ab_ttft.py --variant positions --shapes qwen05b,llama8b --contexts 2048,8192 \
        --strategies full,infoflow,cacheblend
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


def variants(kind: str, engine):
    """({label: setter}, restore): the first label is the candidate, the second the path it is compared to;
    `restore` sets what ships."""
    if kind == "stats":
        from kvfuse.engine import bucketed
        from kvfuse.kernels import attention_and_scores, attention_scores, fused_attention

        def apart(q, q_pos, k, v, rows, pos, cos, sin, scale):
            return (fused_attention(q, q_pos, k, v, rows, pos, cos, sin, scale),
                    attention_scores(q, q_pos, k, rows, pos, cos, sin, scale))

        def use(fn):
            return lambda: setattr(bucketed, "attention_and_scores", fn)
        return {"shared statistics": use(attention_and_scores), "two calls": use(apart)}, use(attention_and_scores)
    if kind == "positions":
        from kvfuse.kernels._triton import attention as tri_attention
        from kvfuse.kernels._triton import attn_scores as tri_scores
        from kvfuse.kernels.attention import positions

        shipped = {tri_attention: tri_attention.launch, tri_scores: tri_scores.launch}

        def reading(mod):
            """mod's launch with kv_pos None materialised as 0..N-1 (read and searched like any given kv_pos)."""
            launch, at = shipped[mod], (5 if mod is tri_attention else 4)

            def run(*a, **kw):
                a = list(a)
                if a[at] is None:
                    a[at] = positions(a[2], a[at - 1], None)
                return launch(*a, **kw)
            return run

        def computed():
            for mod, launch in shipped.items():
                mod.launch = launch

        def read():
            for mod in shipped:
                mod.launch = reading(mod)
        return {"positions computed": computed, "positions read": read}, computed
    module = next(sys.modules[c.__module__] for c in type(engine.decoder).__mro__
                  if hasattr(sys.modules[c.__module__], "linear_add"))
    shipped = module.linear_add

    def separate():
        module.linear_add = shipped
    return {"epilogue": lambda: setattr(module, "linear_add", epilogue_add), "separate add": separate}, separate


def main(argv=None, default_variant: str = "positions") -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", choices=["positions", "epilogue", "stats"], default=default_variant)
    ap.add_argument("--shapes", default="qwen05b")
    ap.add_argument("--contexts", default="8192")
    ap.add_argument("--strategies", default="full")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args(argv)
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
            first = make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64)
            setters, restore = variants(args.variant, first)
            engines = dict(zip(setters, [first, make_engine(model, "pool", pool_tokens=n + 1024, scratch=n + 64)]))
            (a, b) = list(setters)
            for name in args.strategies.split(","):
                times = {v: [] for v in engines}
                for k in range(args.warmup + args.reps):
                    q, docs = random_layout(first, n, 64, vocab, seed=k)
                    for v, eng in engines.items():
                        eng.precompute(docs)
                        setters[v]()
                        r = eng.generate(question_ids=q, docs=docs, strategy=name, recompute_ratio=args.ratio,
                                         max_new_tokens=1)
                        if k >= args.warmup:
                            times[v].append(r.ttft_s)
                restore()
                med = {v: statistics.median(t) * 1e3 for v, t in times.items()}
                print(f"{shape} {n:6d}  {name:10s} {a} {med[a]:8.2f} ms (HF/kvfuse {hf_ms / med[a]:.3f}x)  "
                      f"{b} {med[b]:8.2f} ms ({hf_ms / med[b]:.3f}x)  {b}/{a} {med[b] / med[a]:.3f}", flush=True)
            del engines, first
            if dev == "cuda":
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""TTFT benchmark: Hugging Face transformers SDPA full prefill vs kvfuse's strategies, side by side in one run.

Random bf16 weights at real shapes (timing does not depend on weight values). Two layouts per row:
"first-sight" (the headline: every timed request brings a new random layout, 128-1024-token documents of random
count filling the context, precomputed untimed, as RAG requests do) and "repeated" (`[prefix][doc 512] x n
[question 64]`, the same request every time, so CUDA graphs replay it). `--layouts repeated-random` repeats one
random layout instead: equal documents need less attention work than random ones (which rows get recomputed moves),
so first-sight's own cost is first-sight against repeated-random, not against repeated. Every row is timed from the call with
token ids to the first token's logits (lookup, selection included), median of `--reps` after `--warmup` runs. Caches GPU-resident (one pool, used in place) and CPU-resident
(pinned host memory, streamed layer by layer).

Prints a table (with the ratio HF/kvfuse and each row's arithmetic floor) and writes CSV.

    python benchmarks/ttft.py --shapes llama8b --contexts 2048,8192,32768 --out ttft.csv
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: see kvfuse/__init__.py

SHAPES = {
    # name: (config class, kwargs)
    "llama8b": ("LlamaConfig", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                    max_position_embeddings=131072, rope_theta=500000.0,
                                    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                  "high_freq_factor": 4.0,
                                                  "original_max_position_embeddings": 8192})),
    "qwen7b": ("Qwen2Config", dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                                   num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
                                   max_position_embeddings=131072, rope_theta=1000000.0)),
    "qwen05b": ("Qwen2Config", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                    num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                    max_position_embeddings=32768, rope_theta=1000000.0, tie_word_embeddings=True)),
    "tiny": ("LlamaConfig", dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                                 num_key_value_heads=2, vocab_size=4096, max_position_embeddings=65536)),
}


class _IdsTokenizer:
    """Just enough tokenizer for the engine's constructor (the prompt prefix) and for decoding; requests are given
    as token ids (`question_ids=`, `Document(id, token_ids=...)`), so nothing else is tokenized."""

    chat_template = None
    eos_token_id = None

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [11 + (sum(map(ord, w)) % 1000) for w in text.split()] or [7]}

    def get_vocab(self):
        return {}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def build(shape: str, device: str):
    import transformers

    cls_name, kw = SHAPES[shape]
    cfg = getattr(transformers, cls_name)(**kw)
    cfg._attn_implementation = "sdpa"
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.eval().requires_grad_(False)
    with torch.no_grad():  # small random weights keep bf16 activations finite over many layers
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.02)
    return model


def make_engine(model, tier: str, pool_tokens: int, scratch: int, cuda_graphs: bool = True,
                decode_tokens: int | None = None, **config):
    """An engine over `model` with room for `pool_tokens` document rows, a `scratch`-row prefill and, by default,
    one running request of `scratch` + 64 rows (the benchmarks decode a few tokens of one request at a time; the
    engine's default keeps twice the context window, 8 GB on the 8B shape, which is what made a second engine or a
    32k row after shorter ones run out of an 80 GB card). `config`: other EngineConfig fields."""
    from kvfuse.engine.api import FusionEngine
    from kvfuse.engine.config import EngineConfig

    spec_bytes = 2 * model.config.num_hidden_layers * model.config.num_key_value_heads * (
        model.config.hidden_size // model.config.num_attention_heads) * 2
    cfg = EngineConfig(memory_budget_bytes=pool_tokens * spec_bytes, kv_tier=tier, scratch_tokens=scratch,
                       cuda_graphs=cuda_graphs, decode_tokens=scratch + 64 if decode_tokens is None else decode_tokens,
                       **config)
    return FusionEngine(model, _IdsTokenizer(), cfg, model_name="random", model_fingerprint="bench",
                        tokenizer_fingerprint="ids")


def request(engine, n_ctx: int, doc_tokens: int, q_tokens: int, vocab: int, seed: int):
    """Random documents and a question as token ids; returns (question_ids, docs), for
    `engine.generate(question_ids=..., docs=...)` and `engine.precompute(docs)`."""
    from kvfuse import Document

    g = torch.Generator().manual_seed(seed)
    n_docs = max(1, (n_ctx - q_tokens - len(engine.prompts.prefix_ids)) // doc_tokens)
    docs = [Document(f"s{seed}-d{i}", token_ids=torch.randint(100, vocab - 100, (doc_tokens,), generator=g).tolist())
            for i in range(n_docs)]
    question_ids = torch.randint(100, vocab - 100, (q_tokens,), generator=g).tolist()
    return question_ids, docs


def random_layout(engine, n_ctx: int, q_tokens: int, vocab: int, seed: int):
    """A never-seen layout of about n_ctx tokens: documents of random lengths (128-1024 tokens) and count, as
    token ids; returns (question_ids, docs)."""
    from kvfuse import Document

    g = torch.Generator().manual_seed(10_000 + seed)
    room = n_ctx - q_tokens - len(engine.prompts.prefix_ids)
    docs, used = [], 0
    while used < room:
        n = int(torch.randint(128, 1025, (1,), generator=g))
        n = min(n, room - used)
        if n < 32 and docs:
            break
        docs.append(Document(f"fs{seed}-d{len(docs)}",
                             token_ids=torch.randint(100, vocab - 100, (n,), generator=g).tolist()))
        used += n
    return torch.randint(100, vocab - 100, (q_tokens,), generator=g).tolist(), docs


def hf_prefill(model, ids) -> float:
    """Seconds of one Hugging Face prefill of `ids` [1, n] to its first token (the device synchronised first)."""
    if ids.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model(ids, logits_to_keep=1, use_cache=False)
    int(out.logits[0, -1].argmax())
    return time.perf_counter() - t0


def time_call(fn, reps: int, warmup: int) -> tuple[float, float, float, float]:
    """(median, mean, min, max) seconds of `reps` calls after `warmup`: the mean shows how often mixed traffic runs
    eagerly, min/max a stall on a few calls, both of which the median hides."""
    for _ in range(warmup):
        fn()
    ts = [fn() for _ in range(reps)]
    return statistics.median(ts), statistics.fmean(ts), min(ts), max(ts)


def split_by_graph_use(times: list[float], hows: list[tuple]) -> dict[str, float | None]:
    """Median seconds of the timed calls that replayed a bucket graph, captured one, or ran eagerly (None where no
    call did); `hows[i]` is call i's (replays, captures, eager runs) delta. A first-sight median over few calls mixes
    the three; this says what each costs."""
    out: dict[str, float | None] = {}
    for i, kind in enumerate(("replay", "capture", "eager")):
        ts = [t for t, h in zip(times, hows) if len(h) == 3 and h[i] and not any(h[j] for j in range(3) if j > i)]
        out[kind] = statistics.median(ts) if ts else None
    return out


def floors(model, n: int, recomputed: int, q: int, gemm_tflops: float, hbm_gbs: float) -> dict[str, float]:
    """Arithmetic floor (ms) of a prefill that computes `rows` tokens over an n-token context."""
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    params = sum(p.numel() for p in model.parameters()) - c.vocab_size * c.hidden_size  # embedding is a gather
    weight_bytes = 2 * params
    kv_row = 2 * c.num_hidden_layers * c.num_key_value_heads * hd * 2

    def one(rows: int, kv_read_rows: int) -> float:
        flops = 2 * rows * (params - c.vocab_size * c.hidden_size) + 2 * c.vocab_size * c.hidden_size
        flops += 4 * c.num_hidden_layers * c.num_attention_heads * hd * rows * (kv_read_rows / 2 if rows == n
                                                                                   else kv_read_rows)
        byts = weight_bytes + kv_read_rows * kv_row
        return max(flops / (gemm_tflops * 1e12), byts / (hbm_gbs * 1e9)) * 1e3

    return {"full": one(n, n), "reuse": one(q, n), "fused": one(recomputed + q, n)}


def ceilings(device: str) -> tuple[float, float]:
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    x = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)

    def t(fn, reps=10):
        fn()
        torch.cuda.synchronize()
        s = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - s) / reps

    tflops = 2 * 8192 ** 3 / t(lambda: a @ a) / 1e12
    gbs = 2 * x.numel() / t(lambda: y.copy_(x)) / 1e9
    del a, x, y
    torch.cuda.empty_cache()
    return tflops, gbs


def offline_data(name: str) -> bool:
    """Whether a strategy reads per-document data computed offline besides the plain caches (sift's indexes,
    qcfuse's anchors): the benchmark precomputes it, untimed, as a deployment would. (Cache variants need documents'
    text and are refused up front.)"""
    from kvfuse.engine.fusion import make_strategy

    strat = make_strategy(name)
    return spec_name(name) == "sift" or bool(getattr(strat, "needs_extras", ()))


def spec_name(spec: str) -> str:
    """A strategy spec's registered name (`sift:window=256` -> `sift`)."""
    return spec.split(":", 1)[0]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="llama8b")
    ap.add_argument("--contexts", default="2048,8192,32768")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--ratios", default="", help="several recompute ratios (comma separated; overrides --ratio), "
                                                 "each a row of every strategy that reads one")
    ap.add_argument("--strategies", default="full,reuse,cacheblend,infoflow",
                    help="kvfuse rows (full and reuse ignore the ratio)")
    ap.add_argument("--tiers", default="pool,host", help="pool = GPU-resident, host = pinned CPU-resident")
    ap.add_argument("--host-strategies", default="reuse,cacheblend")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="ttft.csv")
    ap.add_argument("--cuda-graphs", type=int, default=1, help="1: repeated prefills replay CUDA graphs")
    ap.add_argument("--verbose", action="store_true", help="print every call (TTFT, sizes, graph use)")
    ap.add_argument("--row-steps", default="",
                    help="comma list of prompt-row bucket steps per octave to compare side by side (first-sight "
                         "rows of bucketed strategies; default: the engine's own)")
    ap.add_argument("--layouts", default="first-sight,repeated",
                    help="first-sight: every timed request a new random layout (document count and lengths; its "
                         "documents precomputed, untimed); repeated: the same request every time (graph replay; "
                         "equal --doc-tokens documents); repeated-random: one random layout drawn as first-sight draws "
                         "them, repeated (the same workload as first-sight without the novelty: equal documents need "
                         "less attention work, so compare first-sight with this row); "
                         "cold-bucket: a new layout whose shape bucket has no graph yet (the padded path eagerly); "
                         "mixed: as first-sight, with the context (N/2 to N) and question (16-128 tokens) lengths "
                         "drawn per request too, as real traffic (use many --reps: the median then shows how often "
                         "a request finds its bucket's graph); mixed-warm: the same requests after "
                         "`engine.warmup` over their range (the graphs a server captures at start-up); "
                         "cold-compute / cold-auto: every request brings new documents, none precomputed, with "
                         "EngineConfig.cold_documents 'compute' (the default: each computed alone before fusing) or "
                         "'auto' (full prefill when that is predicted to cost less; the documents' caches are built between "
                         "requests, untimed)")
    ap.add_argument("--probe-guard", default="",
                    help="comma list of 'pass' and/or 'trip': also time each probing strategy (infoflow, prophetkv, "
                         "qcfuse) with guard_at='probe' at a margin no gap falls under ('pass': the probe runs on to the "
                         "last layer, one host read, then the fused pass) and at one every gap falls under ('trip': "
                         "the probe, then full prefill answers). A guarded share s of trips costs (1 - s) pass + s trip")
    args = ap.parse_args()

    import transformers
    from kvfuse.engine.fusion import available, probes

    dev = args.device
    info = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    if dev == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
        try:
            import triton
            info["triton"] = triton.__version__
        except ImportError:
            info["triton"] = None
        tflops, gbs = ceilings(dev)
    else:
        info["cpu"] = platform.processor() or platform.machine()
        tflops, gbs = 1.0, 50.0
    info.update(gemm_tflops=round(tflops), copy_gbs=round(gbs), cuda_graphs=bool(args.cuda_graphs))
    print(json.dumps(info), flush=True)
    strategies = [s for s in args.strategies.split(",") if spec_name(s) in available()]  # specs: name:option=value
    from kvfuse.engine.fusion import make_strategy

    textual = [s for s in strategies if getattr(make_strategy(s), "cache_variant", None)]
    if textual:  # refused before any timing, not after the HF rows
        ap.error(f"{','.join(textual)}: a cache variant (fusionrag's, a doc_context's) picks each document's context "
                 "by its text, and this benchmark's documents are random token ids; time it with the same online "
                 "path's strategy (the variant changes the cached K/V, not the request's work)")
    rows = []
    contexts = [int(x) for x in args.contexts.split(",")]

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    for shape in args.shapes.split(","):
        model = build(shape, dev)
        vocab = model.config.vocab_size
        for n in contexts:
            window = model.config.max_position_embeddings
            if n + 8 > window:  # the prompt and its first answer token must fit the model's window
                print(f"{shape}: context {n} capped at {window - 8} (window {window})", flush=True)
                n = window - 8
            ids = torch.randint(100, vocab - 100, (1, n), device=dev)

            def hf_call(ids=ids):
                return hf_prefill(model, ids)

            hf = time_call(hf_call, args.reps, args.warmup)[0]
            base = {"shape": shape, "context": n}
            rows.append({**base, "row": "HF SDPA full", "tier": "-", "ttft_ms": hf * 1e3, "vs_hf": 1.0})
            print(f"{shape} {n:6d}  HF SDPA full                 {hf * 1e3:8.2f} ms", flush=True)
            hf_mixed = None
            if any(lay.startswith("mixed") for lay in args.layouts.split(",")):
                mixed_n = iter(range(1_000_000))

                def hf_mixed_call():  # the mixed rows' prompt lengths (N/2 to N plus a 16-128-token question)
                    g = torch.Generator().manual_seed(20_000 + next(mixed_n))
                    n_i = int(torch.randint(n // 2, n + 1, (1,), generator=g))
                    return hf_call(torch.randint(100, vocab - 100, (1, n_i), device=dev))

                for _ in range(2):
                    hf_call()
                hf_mixed, hf_mixed_mean = time_call(hf_mixed_call, args.reps, 0)[:2]
                rows.append({**base, "row": "HF SDPA full mixed", "tier": "-", "ttft_ms": hf_mixed * 1e3,
                             "mean_ttft_ms": hf_mixed_mean * 1e3, "vs_hf": 1.0})
                print(f"{shape} {n:6d}  HF SDPA full mixed lengths   {hf_mixed * 1e3:8.2f} ms  "
                      f"mean {hf_mixed_mean * 1e3:.2f} ms", flush=True)
            for tier in args.tiers.split(","):
                # sift computes every row (its prompt needs arena rows beside the documents' cached ones)
                pool = (2 * n if any(spec_name(s) == "sift" for s in strategies) else n) + 1024
                engine = make_engine(model, tier, pool_tokens=pool, scratch=n + 64,
                                     cuda_graphs=bool(args.cuda_graphs))
                q, docs = request(engine, n, args.doc_tokens, args.question_tokens, vocab, seed=n)
                engine.precompute(docs)
                for s_ in strategies:  # indexes (sift) and extras (qcfuse's anchors), precomputed like caches
                    if offline_data(s_):
                        engine.precompute(docs, strategy=s_)
                names = strategies if tier == "pool" else [s for s in args.host_strategies.split(",")
                                                             if spec_name(s) in available()]
                steps = [int(x) for x in args.row_steps.split(",") if x] or [None]
                engine_steps = engine.runner.layout.row_steps if engine.runner.layout is not None else None
                ratios = [float(x) for x in args.ratios.split(",") if x] or [args.ratio]
                guards = [None] + [g for g in args.probe_guard.split(",") if g]
                if set(guards) - {None, "pass", "trip"}:
                    ap.error(f"--probe-guard takes pass and/or trip, not {args.probe_guard!r}")
                runs = [(s_, lay, st, ra, gu) for s_ in names
                        for ra in (ratios[:1] if spec_name(s_) in ("full", "reuse", "sift") else ratios)
                        for lay in args.layouts.split(",")
                        for st in (steps if lay in ("first-sight", "mixed", "mixed-warm") else [None])
                        for gu in (guards if probes(s_) else [None])]
                for name, layout, row_steps, ratio, guard in runs:
                    if engine.runner.layout is not None:
                        engine.runner.layout.row_steps = row_steps or engine_steps
                    fresh = iter(range(1_000_000))

                    # a gap is >= 0, so margin 0 never trips; no top-2 gap of a bf16 logit row reaches 1e9
                    guard_kw = ({} if guard is None else
                                {"guard_at": "probe", "guard_margin": 1e-9 if guard == "pass" else 1e9})

                    def call(name=name, ratio=ratio, layout=layout, guard_kw=guard_kw):
                        qi, ds = q, docs
                        if layout == "cold-bucket" and engine.runner.layout is not None:
                            engine.runner.layout.reset()  # forget every bucket's graph: run eagerly
                        if layout in ("mixed", "mixed-warm"):  # real traffic: the context and question lengths vary too
                            seed = next(fresh)
                            g = torch.Generator().manual_seed(20_000 + seed)
                            n_i = int(torch.randint(n // 2, n + 1, (1,), generator=g))
                            q_i = int(torch.randint(16, 129, (1,), generator=g))
                            qi, ds = random_layout(engine, n_i, q_i, vocab, seed)
                            engine.precompute(ds)
                            if offline_data(name):
                                engine.precompute(ds, strategy=name)
                        elif layout == "repeated-random":
                            qi, ds = random_layout(engine, n, args.question_tokens, vocab, 900_000)
                            engine.precompute(ds)  # cached after the first call: a no-op
                            if offline_data(name):
                                engine.precompute(ds, strategy=name)
                        elif layout in ("cold-compute", "cold-auto"):  # new documents: nothing precomputed
                            engine.wait_for_deferred(600)  # what the last request deferred, built untimed
                            engine.config = dataclasses.replace(engine.config, cold_documents=layout[5:])
                            qi, ds = random_layout(engine, n, args.question_tokens, vocab,
                                                   (500_000 if layout == "cold-compute" else 700_000) + next(fresh))
                        elif layout in ("first-sight", "cold-bucket"):
                            qi, ds = random_layout(engine, n, args.question_tokens, vocab, next(fresh))
                            engine.precompute(ds)  # cached, untimed: the layout is what is new
                            if offline_data(name):
                                engine.precompute(ds, strategy=name)
                        engine.wait_for_deferred(600)  # graphs and caches the last request left for idle time
                        sync()
                        lg_ = engine.runner.layout
                        before = (lg_.replays, lg_.captures, lg_.eager_runs) if lg_ is not None else ()
                        r = engine.generate(question_ids=qi, docs=ds, strategy=name, recompute_ratio=ratio,
                                            max_new_tokens=1, **guard_kw)
                        call.last = r
                        after = (lg_.replays, lg_.captures, lg_.eager_runs) if lg_ is not None else ()
                        call.hows.append(tuple(b - a for a, b in zip(before, after)))
                        call.times.append(r.ttft_s)
                        if args.verbose:
                            how = "/".join(str(b - a) for a, b in zip(before, after))
                            print(f"    call {name} {layout}: ttft {r.ttft_s * 1e3:7.2f} ms  prefill "
                                  f"{r.prefill_s * 1e3:7.2f}  sel {r.selection_s * 1e3:6.2f}  n {r.prompt_tokens} "
                                  f"docs {len(ds)}  recomputed {r.recomputed_tokens}  r/c/e {how}"
                                  + (f"  density {r.extra['sift']['density']}" if "sift" in r.extra else ""),
                                  flush=True)
                        return r.ttft_s

                    warm = None
                    if layout in ("mixed", "mixed-warm") and engine.runner.layout is not None:
                        engine.runner.layout.reset()  # both rows start from no graphs: the same requests
                    if layout == "mixed-warm":
                        warm = engine.warmup(contexts=(max(64, n // 2 - 64), n), strategies=[name],
                                             question_tokens=(16, 128), ratios=[ratio])
                        print(f"    warmup {name}: {warm['requests']} requests, {warm['captured']} graphs captured "
                              f"in {warm['seconds']:.1f} s", flush=True)
                    if engine.runner.layout is not None:  # bucket graph counters of this row alone
                        engine.runner.layout.replays = engine.runner.layout.captures = 0
                        engine.runner.layout.eager_runs = 0
                    call.hows = []  # per call: (replays, captures, eager runs) of the bucket graphs
                    call.times = []  # per call: its TTFT (s)
                    t, t_mean, t_min, t_max = time_call(call, args.reps, args.warmup)
                    # the timed calls alone: a first-sight request that captures its bucket's graph (or runs
                    # eagerly) costs far more than a replay, and with few --reps one such call moves the median
                    timed = [sum(c) for c in zip(*call.hows[-args.reps:])] if call.hows and call.hows[-1] else []
                    timed_graphs = "/".join(map(str, timed)) if timed else "-"
                    by_use = split_by_graph_use(call.times[-args.reps:], call.hows[-args.reps:])
                    # mixed rows against HF on the same lengths (the random lengths are seeded alike)
                    ref, ref_mean = ((hf_mixed, hf_mixed_mean) if layout.startswith("mixed") and hf_mixed
                                     else (hf, hf))
                    r = call.last
                    fl = floors(model, r.prompt_tokens, r.recomputed_tokens, r.question_tokens, tflops, gbs)
                    floor = (fl["full"] if spec_name(name) in ("full", "sift") else fl["reuse"] if name == "reuse"
                             else fl["fused"])  # sift computes every token (its attention is sparse)
                    label = name if spec_name(name) in ("full", "reuse", "sift") else f"{name}@{ratio:.0%}"
                    label += f" {layout}"
                    if row_steps is not None:
                        label += f" N/{row_steps}"
                    if guard is not None:
                        label += f" +probeguard {guard}"
                    if r.strategy != spec_name(name):  # cold documents answered by full prefill
                        label += f" ({r.strategy})"
                    lg = engine.runner.layout
                    graphs = (f"{lg.replays}/{lg.captures}/{lg.eager_runs}" if lg is not None else "-")
                    rows.append({**base, "row": f"kvfuse {label}", "tier": tier, "ttft_ms": t * 1e3,
                                 "mean_ttft_ms": t_mean * 1e3, "hf_over_mean": ref_mean / t_mean,
                                 "min_ttft_ms": t_min * 1e3, "max_ttft_ms": t_max * 1e3,
                                 "warmup_s": None if warm is None else warm["seconds"],
                                 "bucket_replays_captures_eager": graphs,
                                 "timed_replays_captures_eager": timed_graphs,
                                 **{f"{k}_median_ms": None if v is None else v * 1e3 for k, v in by_use.items()},
                                 "vs_hf": ref / t, "floor_ms": floor, "measured_over_floor": t * 1e3 / floor,
                                 "selection_ms": r.selection_s * 1e3,
                                 "selection_share": r.selection_s / t, "recomputed": r.recomputed_tokens,
                                 "doc_tokens": r.doc_tokens, "hits": r.cache_hits, "misses": r.cache_misses,
                                 "sift_density": (r.extra.get("sift") or {}).get("density"),
                                 "served_by": r.strategy})
                    print(f"{shape} {n:6d}  kvfuse {label:<30} {tier:<4}  {t * 1e3:8.2f} ms  x{ref / t:6.2f} vs HF  "
                          f"floor {floor:7.2f} ms  sel {r.selection_s * 1e3:6.2f} ms  "
                          f"recomputed {r.recomputed_tokens}/{r.doc_tokens}  bucket graphs r/c/e {graphs}  "
                          f"mean {t_mean * 1e3:.2f} ms (x{ref_mean / t_mean:.2f})  min/max {t_min * 1e3:.2f}/"
                          f"{t_max * 1e3:.2f} ms", flush=True)
                    if timed and timed[0] < args.reps:
                        print("  timed requests by graph use (median ms): " + ", ".join(
                            f"{k} {'-' if v is None else f'{v * 1e3:.2f}'}" for k, v in by_use.items()), flush=True)
                    if timed and timed[0] < args.reps and args.reps < 5:
                        print(f"  note: {args.reps - timed[0]} of the {args.reps} timed requests did not replay a graph "
                              f"(r/c/e {timed_graphs}): the median carries their capture or eager cost; use more "
                              f"--reps for a steady figure", flush=True)
                    if lg is not None and lg.failed:
                        print("  capture failures:", set(lg.failed.values()), flush=True)
                engine.close()
                del engine
                if dev == "cuda":
                    torch.cuda.empty_cache()
        del model
        if dev == "cuda":
            torch.cuda.empty_cache()

    keys = sorted({k for r in rows for k in r}, key=lambda k: list(rows[-1]).index(k) if k in rows[-1] else 99)
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print("\n| shape | context | row | tier | TTFT ms | HF/kvfuse | floor ms | measured/floor | selection share |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['context']} | {r['row']} | {r['tier']} | {r['ttft_ms']:.2f} | {r['vs_hf']:.2f} | "
              f"{r.get('floor_ms', float('nan')):.2f} | {r.get('measured_over_floor', float('nan')):.2f} | "
              f"{r.get('selection_share', float('nan')):.1%} |")
    print(json.dumps(info))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serving benchmark: many clients against one engine, side by side in one run.

Rows (same model, same workload, one process):
- kvfuse batched: the scheduler decodes every running request in one forward (continuous batching), documents
  read in place from the GPU pool;
- kvfuse one-at-a-time: the same engine with max_batch_size=1 (the engine before the scheduler);
- Hugging Face transformers: full prefill of each request's whole prompt + batched `generate` (left padding),
  the clients' requests taken N at a time.

Workload: a corpus of random 512-token documents with Zipf popularity; each request brings 4-16 documents drawn
from it, a fresh 64-token question and asks for 128 tokens (EOS ignored: random weights). Closed loop with N
clients (each sends its next request when the last one ends), and open loop (Poisson arrivals) at fractions of
the batched engine's saturating rate. Random bf16 weights at a real shape (timing does not depend on values).

Reports requests/s, output tokens/s, p50/p99 TTFT and inter-token latency, pool hit rate, the decode step at
batch 32 against its bytes floor (weights + the batch's KV bytes at the measured copy bandwidth), and how many
requests the same memory holds with one physical copy of each document vs a copy per request.

    python benchmarks/serving.py --clients 1,8,32,128 --out serving.csv
"""
from __future__ import annotations

import argparse
import asyncio
import csv
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.append(str(Path(__file__).resolve().parents[1]))  # after site-packages: see kvfuse/__init__.py
import ttft  # noqa: E402  (model shapes, the id tokenizer, bandwidth ceilings)


class Workload:
    """The corpus (token ids, Zipf weights) and a stream of requests drawn from it."""

    def __init__(self, n_docs: int, doc_tokens: int, q_tokens: int, vocab: int, seed: int, zipf: float,
                 docs_per_request: tuple[int, int]) -> None:
        self.g = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.vocab, self.q_tokens = vocab, q_tokens
        self.ids = {f"d{i}": self._rand(doc_tokens) for i in range(n_docs)}
        self.doc_ids = list(self.ids)
        self.weights = [1.0 / (i + 1) ** zipf for i in range(n_docs)]
        self.lo, self.hi = docs_per_request
        self.count = 0

    def _rand(self, n: int) -> list[int]:
        return torch.randint(100, self.vocab - 100, (n,), generator=self.g).tolist()

    def next(self) -> tuple[list[int], list]:
        """(question_ids, documents as token ids) of the next request."""
        from kvfuse import Document

        k = self.rng.randint(self.lo, self.hi)
        chosen: list[str] = []
        while len(chosen) < k:  # Zipf draws without repeats
            d = self.rng.choices(self.doc_ids, self.weights)[0]
            if d not in chosen:
                chosen.append(d)
        self.count += 1
        return self._rand(self.q_tokens), [Document(d, token_ids=self.ids[d]) for d in chosen]

    def corpus(self) -> list:
        from kvfuse import Document

        return [Document(d, token_ids=self.ids[d]) for d in self.doc_ids]


def pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


async def _one(engine, work: Workload, args, log: list) -> None:
    question_ids, docs = work.next()
    t0 = time.perf_counter()
    st = engine.astream(docs=docs, question_ids=question_ids, strategy=args.strategy, recompute_ratio=args.ratio,
                        max_new_tokens=args.output_tokens)
    stamps = []
    async for _ in st:
        stamps.append(time.perf_counter())
    res = st.result
    log.append(dict(t0=t0, t_end=time.perf_counter(), ttft=res.ttft_s, tokens=len(res.token_ids),
                    itl=[b - a for a, b in zip(stamps, stamps[1:])], queue=res.queue_s))


async def closed_loop(engine, work, args, n_clients: int, duration: float) -> list:
    log: list = []
    end = time.perf_counter() + duration

    async def client():
        while time.perf_counter() < end:
            await _one(engine, work, args, log)

    await asyncio.gather(*[client() for _ in range(n_clients)])
    return log


async def open_loop(engine, work, args, rate: float, duration: float, seed: int) -> list:
    log: list = []
    rng = random.Random(seed)
    tasks, t = [], 0.0
    start = time.perf_counter()
    while t < duration:
        t += rng.expovariate(rate)
        delay = start + t - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(engine, work, args, log)))
    await asyncio.gather(*tasks)
    return log


def summarize(name: str, log: list, wall: float, extra: dict) -> dict:
    toks = sum(r["tokens"] for r in log)
    itl = [x for r in log for x in r["itl"]]
    row = dict(row=name, requests=len(log), req_s=len(log) / wall, out_tok_s=toks / wall,
               ttft_p50_ms=pct([r["ttft"] for r in log], 50) * 1e3, ttft_p99_ms=pct([r["ttft"] for r in log], 99) * 1e3,
               itl_p50_ms=pct(itl, 50) * 1e3, itl_p99_ms=pct(itl, 99) * 1e3,
               queue_p50_ms=pct([r["queue"] for r in log], 50) * 1e3)
    row.update(extra)
    print(json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def run_engine(engine, work, args, name: str, mode: str, n: float, duration: float) -> dict:
    before = engine.cache_stats()
    s0 = engine.serving_stats()
    t0 = time.perf_counter()
    if mode == "closed":
        log = asyncio.run(closed_loop(engine, work, args, int(n), duration))
    else:
        log = asyncio.run(open_loop(engine, work, args, n, duration, seed=int(n * 1000)))
    wall = time.perf_counter() - t0
    after = engine.cache_stats()
    s1 = engine.serving_stats()
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    steps = s1["decode_steps"] - s0["decode_steps"]
    return summarize(name, log, wall, dict(mode=mode, load=n, hit_rate=hits / max(1, hits + misses),
                                           peak_batch=s1["peak_batch_size"], decode_steps=steps))


def hf_closed_loop(model, work, args, n_clients: int, duration: float, prefix: list[int]) -> dict:
    """Requests taken N at a time: full prefill of each whole prompt (left padded) + batched greedy generate."""
    from transformers import LogitsProcessor, LogitsProcessorList

    class FirstCall(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                torch.cuda.synchronize()
                self.t = time.perf_counter()
            return scores

    dev = next(model.parameters()).device
    log = []
    t_start = time.perf_counter()
    while time.perf_counter() - t_start < duration:
        prompts = []
        for _ in range(n_clients):
            question_ids, docs = work.next()
            prompts.append(prefix + [t for d in docs for t in d.token_ids] + question_ids)
        width = max(map(len, prompts))
        ids = torch.zeros((n_clients, width), dtype=torch.long)
        mask = torch.zeros((n_clients, width), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        first = FirstCall()
        t0 = time.perf_counter()
        with torch.inference_mode():
            model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), max_new_tokens=args.output_tokens,
                           min_new_tokens=args.output_tokens, do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([first]))
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        itl = (t1 - first.t) / max(1, args.output_tokens - 1)
        for _ in prompts:
            log.append(dict(t0=t0, t_end=t1, ttft=first.t - t0, tokens=args.output_tokens,
                            itl=[itl] * (args.output_tokens - 1), queue=0.0))
    wall = time.perf_counter() - t_start
    return summarize(f"hf full+generate N={n_clients}", log, wall, dict(mode="closed", load=n_clients))


def decode_step_vs_floor(engine, model, batch: int, ctx: int, gbs: float) -> dict:
    """Times `Decoding.step` for `batch` sequences of `ctx` positions (graph replay) against its bytes floor."""
    dec = engine.decoding
    arena = dec.arena
    seqs = []
    from kvfuse.engine.decode import Sequence

    for _ in range(batch):
        slab = arena.alloc(ctx + 64)
        seqs.append(Sequence(row_map=slab.rows(arena.pool.k.device), length=ctx, prompt_len=ctx, slab=slab))
    toks = [1] * batch
    for _ in range(3):
        dec.step(seqs, toks)
    for sq in seqs:
        sq.length = ctx
    torch.cuda.synchronize()
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        dec.step(seqs, toks)
    torch.cuda.synchronize()
    step = (time.perf_counter() - t0) / reps
    for sq in seqs:
        dec.close(sq)
    c = model.config
    hd = c.hidden_size // c.num_attention_heads
    weights = 2 * sum(p.numel() for p in model.parameters()) - 2 * c.vocab_size * c.hidden_size  # embedding: gather
    kv = batch * (ctx + reps // 2) * 2 * c.num_hidden_layers * c.num_key_value_heads * hd * 2
    floor = (weights + kv) / (gbs * 1e9)
    row = dict(row=f"decode step, batch {batch}, {ctx} positions each", step_ms=step * 1e3, floor_ms=floor * 1e3,
               ratio_to_floor=step / floor)
    print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}), flush=True)
    return row


def free(engine) -> None:
    """Closes an engine and gives its pool, arena and graph memory back before the next row."""
    import gc

    engine.close()
    engine.decoding.graphs = None
    engine.runner.graphs = None
    for pool in {id(p): p for p in (engine.decoding.arena.pool, engine.store.memory.pool) if p is not None}.values():
        pool.k = pool.v = None
    engine.store.memory._items.clear()
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama8b")
    ap.add_argument("--clients", default="1,8,32,128")
    ap.add_argument("--serial-clients", default="1,32", help="closed-loop loads for the one-at-a-time engine")
    ap.add_argument("--hf-clients", default="1,8,32")
    ap.add_argument("--open-rates", default="0.5,0.9", help="fractions of the batched engine's saturating rate")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per row")
    ap.add_argument("--corpus", type=int, default=64)
    ap.add_argument("--large-corpus", type=int, default=4, help="x corpus on the host tier (0: skip)")
    ap.add_argument("--docs", default="4,16")
    ap.add_argument("--doc-tokens", type=int, default=512)
    ap.add_argument("--question-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--strategy", default="infoflow")
    ap.add_argument("--ratio", type=float, default=0.15)
    ap.add_argument("--zipf", type=float, default=1.0)
    ap.add_argument("--pool-gib", type=float, default=16.0)
    ap.add_argument("--host-arena-gib", type=float, default=24.0, help="decode rows of the host-tier engine")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="serving.csv")
    args = ap.parse_args()

    import transformers
    from kvfuse.engine.api import FusionEngine
    from kvfuse.engine.config import EngineConfig

    dev = args.device
    info = {"torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version(), "strategy": args.strategy, "ratio": args.ratio}
    tflops, gbs = ttft.ceilings(dev) if dev == "cuda" else (1.0, 50.0)
    if dev == "cuda":
        info["gpu"] = torch.cuda.get_device_name(0)
    info.update(gemm_tflops=round(tflops), copy_gbs=round(gbs))
    print(json.dumps(info), flush=True)
    model = ttft.build(args.shape, dev)
    lo, hi = (int(x) for x in args.docs.split(","))

    c = model.config
    row_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 2

    def engine(max_batch: int, tier: str = "pool", pool_gib: float = args.pool_gib) -> FusionEngine:
        cfg = EngineConfig(memory_budget_bytes=int(pool_gib * (1 << 30)), kv_tier=tier, max_batch_size=max_batch,
                           max_queued_requests=4096, scratch_tokens=hi * args.doc_tokens + 256,
                           decode_tokens=int(args.host_arena_gib * (1 << 30)) // row_bytes if tier == "host" else 0)
        e = FusionEngine(model, ttft._IdsTokenizer(), cfg, model_name="random", model_fingerprint="bench",
                         tokenizer_fingerprint="ids")
        e.eos_ids = set()  # random weights: every request decodes all its tokens
        return e

    def workload(n_docs: int, seed: int) -> Workload:
        return Workload(n_docs, args.doc_tokens, args.question_tokens, model.config.vocab_size, seed, args.zipf,
                        (lo, hi))

    rows = []
    work = workload(args.corpus, 1)
    prefix = list(range(11, 11 + 32))  # about the engine's prompt prefix
    for n in [int(x) for x in args.hf_clients.split(",") if x]:  # first: it needs the most transient memory
        rows.append(hf_closed_loop(model, work, args, n, args.duration, prefix))
        torch.cuda.empty_cache()
    batched = engine(256)
    t0 = time.perf_counter()
    batched.precompute(work.corpus())
    print(json.dumps({"precompute_s": round(time.perf_counter() - t0, 1), "documents": args.corpus}), flush=True)
    run_engine(batched, work, args, "warm-up", "closed", 8, 5.0)  # Triton compiles, graph captures
    sat = 0.0
    for n in [int(x) for x in args.clients.split(",") if x]:
        row = run_engine(batched, work, args, f"kvfuse batched N={n}", "closed", n, args.duration)
        sat = max(sat, row["req_s"])
        rows.append(row)
    for frac in [float(x) for x in args.open_rates.split(",") if x]:
        rows.append(run_engine(batched, work, args, f"kvfuse batched open {frac:g}x sat ({frac * sat:.2f} req/s)",
                               "open", frac * sat, args.duration))
    # one physical copy vs a copy per request, from the sequences the last runs opened
    private = batched.scheduler.private_rows_seen
    copy = batched.scheduler.prompt_rows_seen
    if private:
        corpus_rows = args.corpus * args.doc_tokens
        budget_rows = batched.decoding.arena.pool.doc_rows
        one_copy = (budget_rows - corpus_rows) / (statistics.mean(private) + 0)
        per_request = budget_rows / statistics.mean(copy)
        rows.append(dict(row="concurrent requests in the same pool", one_copy=one_copy, copy_per_request=per_request,
                         ratio=one_copy / per_request, private_rows_mean=statistics.mean(private),
                         rows_per_request_if_copied=statistics.mean(copy)))
        print(json.dumps(rows[-1]), flush=True)
    if dev == "cuda":
        rows.append(decode_step_vs_floor(batched, model, 32, (lo + hi) // 2 * args.doc_tokens + 64, gbs))
    free(batched)
    del batched
    serial = engine(1)
    serial.precompute(work.corpus())
    for n in [int(x) for x in args.serial_clients.split(",") if x]:
        rows.append(run_engine(serial, work, args, f"kvfuse one-at-a-time N={n}", "closed", n, args.duration))
    free(serial)
    del serial
    if args.large_corpus:
        big = workload(args.corpus * args.large_corpus, 2)
        host = engine(256, tier="host", pool_gib=args.pool_gib)
        host.precompute(big.corpus())
        rows.append(run_engine(host, big, args, f"kvfuse batched, {args.large_corpus}x corpus, host tier N=32",
                               "closed", 32, args.duration))
        free(host)
        del host
    by = {r["row"]: r for r in rows}
    for n in (32,):
        b, s, h = (by.get(f"kvfuse batched N={n}"), by.get(f"kvfuse one-at-a-time N={n}"),
                   by.get(f"hf full+generate N={n}"))
        if b and s and h:
            print(json.dumps({"N": n, "batched_vs_one_at_a_time": round(b["req_s"] / s["req_s"], 2),
                              "batched_vs_hf": round(b["req_s"] / h["req_s"], 2)}), flush=True)
    keys = sorted({k for r in rows for k in r})
    with open(args.out, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

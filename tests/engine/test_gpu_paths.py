"""GPU-only paths (skipped without CUDA): Triton kernels inside the engine, the pooled tier, the pinned host
tier streamed layer by layer, and CUDA-graph replay of prefills and decode steps, each against the eager
reference path on the same inputs."""
from __future__ import annotations

import threading

import pytest
import torch
from cases import DOCS, QUESTION, mid_answer_departure
from fixtures import load_tiny

from kvfuse.engine.api import FusionEngine
from kvfuse.engine.config import EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _engine(family: str, **config) -> FusionEngine:
    config.setdefault("memory_budget_bytes", 256 << 20)  # a tiny model's pool: the file's engines fit beside others
    model, tok, info = load_tiny(family, dtype=torch.float32)
    model = model.to(device="cuda", dtype=torch.bfloat16)
    return FusionEngine(model, tok, EngineConfig(**config), model_name=info.name,
                        model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
@pytest.mark.parametrize("strategy,ratio", [("full", 1.0), ("reuse", 0.0), ("cacheblend", 0.3), ("infoflow", 0.3),
                                            ("infoflow:doc_context=pool", 0.3)])
def test_graphs_and_tiers_match_eager(family, strategy, ratio):
    eager = _engine(family, kv_tier="pool", cuda_graphs=False)
    graphs = _engine(family, kv_tier="pool", cuda_graphs=True)
    host = _engine(family, kv_tier="host", cuda_graphs=False)
    assert graphs.runner.layout.keep_warm and graphs.runner.graphs.keep_warm  # capturing call: its warm-up answers
    assert not graphs.runner.layout.defer  # the default: captured on the due request's path (idle time: next test)
    kw = dict(strategy=strategy, recompute_ratio=ratio, max_new_tokens=6, return_logprobs=True)
    ref = eager.generate(QUESTION, DOCS, **kw)
    for engine in (graphs, host):
        for _ in range(3):  # 1st eager, 2nd captures, 3rd replays
            r = engine.generate(QUESTION, DOCS, **kw)
            assert r.token_ids == ref.token_ids
            torch.testing.assert_close(r.extra["logprobs"], ref.extra["logprobs"], rtol=0.05, atol=0.05)
    # the repeated request was captured and replayed: as its shape bucket (layout-free strategies) or its signature
    assert len(graphs.runner.layout.entries) + len(graphs.runner.graphs.entries) == 1
    other = DOCS[::-1]  # a different layout under the same strategy: a new signature, still right
    a = eager.generate(QUESTION, other, **kw)
    b = graphs.generate(QUESTION, other, **kw)
    assert a.token_ids == b.token_ids


@pytest.mark.parametrize("strategy", ["full", "reuse", "epic", "cacheblend", "infoflow", "prophetkv", "qcfuse",
                                      "infoflow:doc_context=pool"])
def test_bucket_graphs_serve_new_layouts_like_eager(strategy):
    """Never-seen layouts (documents reordered, dropped; questions a few words longer) that share a shape bucket
    replay one graph and give the tokens of the same padded prefill run eagerly; a fused bucket's graph keeps no
    per-layer K/V (the sequence reads them from the pool's scratch rows)."""
    eager = _engine("llama3", kv_tier="pool", cuda_graphs=False, memory_budget_bytes=64 << 20)
    graphs = _engine("llama3", kv_tier="pool", cuda_graphs=True, memory_budget_bytes=64 << 20, idle_captures=True)
    longer = QUESTION + " Answer briefly."
    layouts = [(QUESTION, DOCS), (longer, DOCS[::-1]), (QUESTION, [DOCS[1], DOCS[0], DOCS[2]]),
               (longer, [DOCS[2], DOCS[1], DOCS[0]]), (QUESTION, DOCS[:2] + DOCS[2:])]
    kw = dict(strategy=strategy, recompute_ratio=0.3, max_new_tokens=6)
    lg = graphs.runner.layout
    assert lg.keep_warm  # the default: a capturing request answers from its capture's warm-up run
    assert lg.defer  # idle_captures: a bucket due for capture is captured in idle time (the eager engine is idle then)
    ways = []
    for question, docs in layouts:
        ref = eager.generate(question, docs, **kw)
        before = (lg.eager_runs, lg.captures, lg.replays)
        got = graphs.generate(question, docs, **kw)
        assert graphs.wait_for_deferred(120)  # a capture the request left for idle time is made here
        ways.append(tuple(b - a for a, b in zip(before, (lg.eager_runs, lg.captures, lg.replays))))
        assert got.token_ids == ref.token_ids
        assert got.recomputed_tokens == ref.recomputed_tokens
    # each request ran one way: eager (its bucket's first sighting), eager and then captured in idle time (its
    # second), or a replay; a capture on a request's path (a replay-free answer from the warm-up run) only when the
    # engine was not idle in between, which waiting above rules out
    assert set(ways) <= {(1, 0, 0), (1, 1, 0), (0, 0, 1)}, ways
    assert lg.captures >= 1 and lg.replays >= 1 and lg.eager_runs == lg.captures + len(lg.seen), ways
    if strategy != "full":  # each entry: (inputs, select graph, main graph, (logits, per-layer K/V, active, chosen))
        assert all(len(entry[3][1]) == 0 for entry in lg.entries.values())
    assert len(graphs.runner.graphs.entries) == 0  # no exact-layout graph was needed
    eager.close()
    graphs.close()


@pytest.mark.parametrize("strategy", ["full", "cacheblend", "infoflow"])
def test_warmup_captures_the_buckets_of_a_range_so_new_requests_replay(strategy):
    """After `warmup` over a range of prompt and tail lengths, never-seen requests in that range (random
    documents, counts, lengths, tails) replay a graph on their first sight, capture nothing, and give the eager
    padded prefill's tokens."""
    from kvfuse import Document

    eager = _engine("llama3", kv_tier="pool", cuda_graphs=False, memory_budget_bytes=64 << 20)
    graphs = _engine("llama3", kv_tier="pool", cuda_graphs=True, memory_budget_bytes=64 << 20)
    kw = dict(strategy=strategy, recompute_ratio=0.2, max_new_tokens=4)
    stats = graphs.warmup(contexts=(200, 700), strategies=[strategy], question_tokens=(8, 40), ratios=[0.2])
    assert stats["captured"] >= 1 and stats["requests"] >= stats["captured"]
    assert graphs.forget(["kvfuse-warmup-0"]) == 0  # the synthetic documents were forgotten
    lg = graphs.runner.layout if strategy == "full" else graphs.fused_runner.layout
    lg.replays = lg.captures = lg.eager_runs = 0
    g = torch.Generator().manual_seed(7)
    vocab = graphs.decoder.spec.vocab
    for i in range(6):
        lens = torch.randint(40, 160, (int(torch.randint(2, 5, (1,), generator=g)),), generator=g).tolist()
        docs = [Document(f"r{i}-{j}", token_ids=torch.randint(1, vocab - 1, (n,), generator=g).tolist())
                for j, n in enumerate(lens)]
        q = torch.randint(1, vocab - 1, (int(torch.randint(8, 41, (1,), generator=g)),), generator=g).tolist()
        if not 200 <= sum(lens) + len(q) + len(graphs.prompts.prefix_ids) <= 700:
            continue
        ref = eager.generate(question_ids=q, docs=docs, **kw)
        got = graphs.generate(question_ids=q, docs=docs, **kw)
        assert got.token_ids == ref.token_ids
    assert lg.captures == 0 and lg.eager_runs == 0 and lg.replays >= 1, (lg.replays, lg.captures, lg.eager_runs)
    eager.close()
    graphs.close()


@pytest.mark.parametrize("strategy", ["infoflow", "prophetkv"])
def test_the_probe_guard_reads_the_same_gap_from_replayed_bucket_graphs(strategy):
    """guard_at="probe" on CUDA: the select graph of a bucket captured with the probe's first-token gap gives the
    eager path's gap; above it every request (eager, captured, replayed) is handed to full prefill with no fused
    pass, below it the answers are the fused ones."""
    eager = _engine("llama3", kv_tier="pool", cuda_graphs=False)
    graphs = _engine("llama3", kv_tier="pool", cuda_graphs=True)
    longer = QUESTION + " Answer briefly."
    layouts = [(QUESTION, DOCS), (longer, DOCS[::-1]), (QUESTION, [DOCS[1], DOCS[0], DOCS[2]]),
               (longer, [DOCS[2], DOCS[1], DOCS[0]])]
    kw = dict(strategy=strategy, recompute_ratio=0.3, max_new_tokens=6, guard_at="probe")
    for question, docs in layouts:
        ref = eager.generate(question, docs, guard_margin=1e9, **kw)
        got = graphs.generate(question, docs, guard_margin=1e9, **kw)
        full = eager.generate(question, docs, strategy="full", max_new_tokens=6)
        assert ref.strategy == got.strategy == "full" and got.token_ids == ref.token_ids == full.token_ids
        gap = ref.extra["guard"]["margin"]
        assert got.extra["guard"]["margin"] == pytest.approx(gap, abs=0.05)  # bf16 on both paths
        plain = eager.generate(question, docs, **{**kw, "guard_at": None})
        low = graphs.generate(question, docs, guard_margin=max(gap - 0.2, 1e-3), **kw)
        assert low.strategy == strategy and low.token_ids == plain.token_ids and "guard" not in low.extra
    lg = graphs.fused_runner.layout
    assert lg.captures >= 1 and lg.replays >= 2, (lg.captures, lg.replays, lg.eager_runs)
    eager.close()
    graphs.close()


def test_cpu_reference_and_triton_engine_agree():
    cpu_model, tok, info = load_tiny("llama", dtype=torch.float32)
    cpu = FusionEngine(cpu_model, tok, EngineConfig(), model_fingerprint=info.fingerprint,
                       tokenizer_fingerprint=info.tokenizer_fingerprint)
    gpu = _engine("llama", kv_tier="pool")
    gpu_fp32 = FusionEngine(load_tiny("llama", dtype=torch.float32)[0].cuda(), tok, EngineConfig(kv_tier="pool"),
                            model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)
    a = cpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy="cacheblend", recompute_ratio=0.3)
    b = gpu_fp32.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy="cacheblend", recompute_ratio=0.3)
    torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    c = gpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy="cacheblend", recompute_ratio=0.3)
    torch.testing.assert_close(c, b, rtol=0.1, atol=0.1)  # the bf16 engine stays near fp32


def _fp32_engine(family: str, **config) -> FusionEngine:
    config.setdefault("memory_budget_bytes", 256 << 20)
    model, tok, info = load_tiny(family, dtype=torch.float32)
    return FusionEngine(model.cuda(), tok, EngineConfig(**config), model_name=info.name,
                        model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)


@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_batched_decode_graphs_match_single_eager(family):
    """Requests decoded together through CUDA graphs of the batched step (one per batch bucket) give each the
    tokens it gets alone on the eager path."""
    eager = _fp32_engine(family, kv_tier="pool", cuda_graphs=False)
    graphs = _fp32_engine(family, kv_tier="pool", cuda_graphs=True)
    reqs = [("full", 1.0, DOCS, QUESTION, 12), ("reuse", 0.0, DOCS[:2], "Who founded it?", 7),
            ("cacheblend", 0.3, DOCS, QUESTION, 15), ("epic", 0.2, DOCS[1:], "What was mined?", 9),
            ("infoflow", 0.15, DOCS[::-1], QUESTION, 11)]
    solo = [eager.generate(q, d, strategy=s, recompute_ratio=r, max_new_tokens=n).token_ids for s, r, d, q, n in reqs]
    for order in ([0, 1, 2, 3, 4], [4, 2, 0, 3, 1]):
        streams = [graphs.stream(reqs[i][3], reqs[i][2], strategy=reqs[i][0], recompute_ratio=reqs[i][1],
                                 max_new_tokens=reqs[i][4]) for i in order]
        for st in streams:
            next(st, None)
        for st in streams:
            list(st)
        assert [st.result.token_ids for st in streams] == [solo[i] for i in order]
    assert graphs.serving_stats()["peak_batch_size"] >= 3
    assert len(graphs.decoding.graphs.entries) >= 2  # several batch buckets captured and replayed


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_guard_hands_over_on_cuda_at_the_first_token_and_mid_answer(graphs):
    """The guard on CUDA (pooled arena, batched decode steps replayed as graphs): above every margin the answer is
    full prefill's; at a mid-answer near-tie the fused tokens before it stay and every token from there is full
    prefill's greedy one given the answer so far, alone and beside another request, with every arena row back."""
    eng = _fp32_engine("qwen2", kv_tier="pool", cuda_graphs=graphs, memory_budget_bytes=1 << 28)
    eng.precompute(DOCS)
    full = eng.generate(QUESTION, DOCS, strategy="full", max_new_tokens=8)
    first = eng.generate(QUESTION, DOCS, strategy="reuse", max_new_tokens=8, guard_margin=1e9)
    assert first.token_ids == full.token_ids and first.extra["guard"]["escalated_at"] == 0
    strategy, q, guard, t, fused = mid_answer_departure(eng, 8)
    kw = dict(strategy=strategy, recompute_ratio=0.15, max_new_tokens=8, guard_margin=guard)
    free = eng.decoding.arena.pool.free_rows
    solo = []
    for _ in range(2):  # the second run replays what the first captured
        g = eng.generate(q, DOCS, **kw)
        assert g.extra["guard"]["escalated_at"] == t and g.strategy == "full"
        assert g.token_ids[:t] == fused.token_ids[:t] and g.token_ids[t] != fused.token_ids[t]
        scored = eng.generate(q, DOCS, strategy="full", max_new_tokens=1, teacher_ids=g.token_ids)
        assert g.token_ids[t:] == scored.extra["teacher_logprobs"][t:].argmax(-1).tolist()[:len(g.token_ids) - t]
        solo.append(g.token_ids)
    assert solo[0] == solo[1]
    other = eng.generate(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3, max_new_tokens=8)
    streams = [eng.stream(q, DOCS, **kw), eng.stream(QUESTION, DOCS, strategy="cacheblend", recompute_ratio=0.3,
                                                     max_new_tokens=8)]
    threads = [threading.Thread(target=lambda s=s: [None for _ in s]) for s in streams]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    assert streams[0].result.token_ids == solo[0] and streams[1].result.token_ids == other.token_ids
    assert not eng.store.memory.pins and eng.decoding.arena.pool.free_rows == free
    eng.close()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_user_path_gguf_converted_then_served_with_every_strategy(tmp_path, graphs):
    """A user's first run in one process: a GGUF converted, loaded on CUDA, every strategy cold (documents
    computed by the request) then warm (cached), eager and graphed: no fault, and cold == warm tokens."""
    from fixtures import tiny_gguf_path

    from kvfuse.engine.fusion import available

    engine = FusionEngine.from_pretrained(str(tiny_gguf_path()), device="cuda", dtype="bf16", cache_dir=tmp_path,
                                          cuda_graphs=graphs)
    from fixtures import word_embedder

    from kvfuse.engine.corpus import Corpus

    engine.corpus = Corpus(word_embedder()).add(DOCS)  # fusionrag's neighbours
    for strategy in available():
        engine.forget([d[0] for d in DOCS])
        runs = [engine.generate(QUESTION, DOCS, strategy=strategy, recompute_ratio=0.3, max_new_tokens=8)
                for _ in range(3)]  # cold, warm, warm again (a graph signature seen twice is captured)
        torch.cuda.synchronize()
        if strategy not in ("full", "sift"):  # sift reads per-document indexes, not K/V caches
            # fusionrag's default variant reads its neighbours' plain caches too (a miss each when not cached yet)
            cold = runs[0].cache_misses >= len(DOCS) if strategy == "fusionrag" else runs[0].cache_misses == len(DOCS)
            assert cold and runs[1].cache_hits == len(DOCS), strategy
        assert runs[0].token_ids == runs[1].token_ids == runs[2].token_ids, strategy


def test_model_off_the_engine_device_is_refused():
    model, tok, info = load_tiny("llama", dtype=torch.float32)
    model = model.cuda()
    model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().cpu())
    with pytest.raises(ValueError, match="lm_head"):
        FusionEngine(model, tok, EngineConfig(), model_fingerprint=info.fingerprint,
                     tokenizer_fingerprint=info.tokenizer_fingerprint)


def test_sift_on_every_tier_matches_the_cpu_plan():
    """sift on CUDA: pool and pinned host tier (whose shared prefix lives in host memory: index computation once
    failed there) give the same tokens; the block lists built on the GPU equal those built on the CPU; an index
    carried as bytes is served without the store."""
    from kvfuse import Document
    from kvfuse.engine.fusion import make_strategy
    from kvfuse.engine.sift import sparse_plan

    kw = dict(strategy="sift", local_mass=0.6, cross_mass=0.4, kernel_block=16, on_miss="compute", max_new_tokens=6,
              min_tokens=0, max_density=1.0)
    pool = _engine("llama3", kv_tier="pool")
    host = _engine("llama3", kv_tier="host")
    ref = pool.generate(QUESTION, DOCS, **kw)
    got = host.generate(QUESTION, DOCS, **kw)
    assert got.token_ids == ref.token_ids and got.extra["sift"]["density"] == ref.extra["sift"]["density"] < 1.0
    layout = pool.layout(QUESTION, DOCS)
    strat = make_strategy("sift", local_mass=0.6, cross_mass=0.4)
    idx = [pool.sift_indexes.get(pool._sift_key(ids.tolist(), strat)) for ids in layout.doc_ids]
    assert all(i is not None for i in idx)
    spans = [(sp.start, sp.end, i) for sp, i in zip(layout.docs, idx)]
    a = sparse_plan(layout.n, pool.decoder.spec.n_layers, spans, 16, "cuda")
    b = sparse_plan(layout.n, pool.decoder.spec.n_layers, spans, 16, "cpu")
    assert a[2] == b[2] and all(torch.equal(x.cpu(), y) for x, y in zip(a[0] + a[1], b[0] + b[1]))
    blobs = pool.sift_index_bytes(DOCS, "sift:local_mass=0.6:cross_mass=0.4")
    fresh = _engine("llama3", kv_tier="pool")
    carried = fresh.generate(QUESTION, [Document(d[0], d[1], sift_index=x) for d, x in zip(DOCS, blobs)], **kw)
    assert carried.extra["sift"]["index_carried"] == len(DOCS) and carried.token_ids == ref.token_ids
    for e in (pool, host, fresh):
        e.close()


@pytest.mark.parametrize("stage", ["offline", "online"])
def test_fusion_adapters_on_cuda_match_the_cpu_and_eager_paths(stage):
    """A fusion adapter of either stage served on CUDA: fp32 on the GPU equals the CPU engine with the same adapter
    (an online one runs merged weights on its own bucketed runner), bucket graphs give the eager tokens, and `full`
    stays the base model."""
    from kvfuse.engine.adapter import FusionAdapter

    cpu_model, tok, info = load_tiny("llama", dtype=torch.float32)
    cpu_base = FusionEngine(cpu_model, tok, EngineConfig(), model_fingerprint=info.fingerprint,
                            tokenizer_fingerprint=info.tokenizer_fingerprint)
    ad = FusionAdapter.init(cpu_base.decoder, rank=4, alpha=8.0, seed=3, stage=stage)
    g = torch.Generator().manual_seed(3)
    for t in ad.targets:
        ad.B[t] = torch.randn(ad.B[t].shape, generator=g) * 0.05
    small = 1 << 28  # a pool sized to the test, not to the free GPU memory (engines of earlier tests may live)
    kw = dict(model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint, adapter=ad)
    cpu = FusionEngine(cpu_model, tok, EngineConfig(), **kw)
    gpu = FusionEngine(load_tiny("llama", dtype=torch.float32)[0].cuda(), tok,
                       EngineConfig(kv_tier="pool", memory_budget_bytes=small), **kw)
    for strat in ("reuse", "cacheblend", "infoflow"):
        a = cpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy=strat, recompute_ratio=0.3)
        b = gpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy=strat, recompute_ratio=0.3)
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-3)
    base = cpu_base.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy="reuse")
    assert (base - cpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy="reuse")).abs().max() > 1e-3
    torch.testing.assert_close(gpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy="full"),
                               cpu_base.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy="full"),
                               rtol=1e-3, atol=1e-3)
    bf = dict(adapter=ad, model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)
    model, _, _ = load_tiny("llama", dtype=torch.float32)
    eager = FusionEngine(model.to("cuda", torch.bfloat16), tok,
                         EngineConfig(kv_tier="pool", cuda_graphs=False, memory_budget_bytes=small), **bf)
    model, _, _ = load_tiny("llama", dtype=torch.float32)
    graphs = FusionEngine(model.to("cuda", torch.bfloat16), tok, EngineConfig(kv_tier="pool", memory_budget_bytes=small),
                          **bf)
    for docs in (DOCS, DOCS[::-1], DOCS):
        ref = eager.generate(QUESTION, docs, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=6)
        for _ in range(2):
            assert graphs.generate(QUESTION, docs, strategy="infoflow", recompute_ratio=0.3,
                                   max_new_tokens=6).token_ids == ref.token_ids
    if stage == "online":
        assert graphs.fused_runner is not graphs.runner and graphs.fused_runner.layout.captures >= 1
    for e in (gpu, eager, graphs):
        e.close()


@pytest.mark.parametrize("strategy", ["infoflow:drift=0.7:drift_from=0.5", "cacheblend:drift=0.5:drift_from=0.5"])
def test_drift_on_cuda_pool_and_host_tiers_matches_the_cpu(strategy):
    """The drift correction writes corrected rows to the request's scratch rows (pool tier: bucket graphs, captured
    and replayed) or its private buffers (host tier: eager), and serves what the CPU engine serves."""
    cpu_model, tok, info = load_tiny("llama", dtype=torch.float32)
    cpu = FusionEngine(cpu_model, tok, EngineConfig(), model_fingerprint=info.fingerprint,
                       tokenizer_fingerprint=info.tokenizer_fingerprint)
    ref = cpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy=strategy, recompute_ratio=0.3)
    plain = cpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy=strategy.split(":")[0],
                                    recompute_ratio=0.3)
    assert (ref - plain).abs().max() > 1e-3
    for tier in ("pool", "host"):
        gpu = _fp32_engine("llama", kv_tier=tier, cuda_graphs=True)
        for _ in range(3):  # 1st eager, 2nd captures, 3rd replays (pool tier)
            got = gpu.next_token_logprobs(QUESTION, DOCS, [11, 12, 13], strategy=strategy, recompute_ratio=0.3)
            torch.testing.assert_close(got.cpu(), ref, rtol=1e-3, atol=1e-3)
        if tier == "pool":
            assert gpu.runner.layout.replays >= 1 and len(gpu.runner.layout.entries) == 1
        for docs in (DOCS[::-1], DOCS[1:] + DOCS[:1]):  # new layouts in the same bucket: replayed, still right
            got = gpu.next_token_logprobs(QUESTION, docs, [11, 12, 13], strategy=strategy, recompute_ratio=0.3)
            want = cpu.next_token_logprobs(QUESTION, docs, [11, 12, 13], strategy=strategy, recompute_ratio=0.3)
            torch.testing.assert_close(got.cpu(), want, rtol=1e-3, atol=1e-3)


def test_gpu_memory_share_fills_the_card_to_its_share():
    """The pool grown to `gpu_memory_share` leaves the card at that share of its memory in use (the reading the
    share is computed from: weights, this process's other engines and other processes all counted), and the grown
    engine serves what a small one serves."""
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    share = min(0.95, (total - free + (2 << 30)) / total)  # about 2 GiB more than what is in use now
    small = _engine("llama3", kv_tier="pool")
    big = _engine("llama3", kv_tier="pool", gpu_memory_share=share)
    free_after, _ = torch.cuda.mem_get_info()
    # the engine's own reading: what the caching allocator holds unused (temporaries of the engine's construction
    # after its pool was made) is free to the next allocation
    in_use = total - free_after - (torch.cuda.memory_reserved() - torch.cuda.memory_allocated())
    pool = big.store.memory.pool
    assert pool.k.numel() * pool.k.element_size() * 2 > (1 << 30)  # grown well past the 256 MiB budget
    # the small engine was made before the big one, so it counts against the share; the big engine's allocations
    # after its pool (prefix, tables) are small
    assert abs(in_use - share * total) < (256 << 20), (in_use, share * total, total - free_after)
    kw = dict(strategy="infoflow", recompute_ratio=0.3, max_new_tokens=6)
    assert big.generate(QUESTION, DOCS, **kw).token_ids == small.generate(QUESTION, DOCS, **kw).token_ids
    del big, pool
    gc.collect()
    torch.cuda.empty_cache()


@pytest.mark.parametrize("family", ["llama3", "qwen2", "qwen3"])
def test_documents_pass_on_cuda_matches_one_prefill_per_document(family):
    """The documents pass on CUDA (padded attention, all new documents in one pass) gives each document the cache the
    runner's own one-document prefill gives, up to bf16 rounding, and a cold request the same answer."""
    from kvfuse.engine.docpass import documents_pass
    from kvfuse.engine.fusion.reuse import Reuse
    from kvfuse.engine.types import Document

    batched = _engine(family, kv_tier="pool")  # the default: one pass
    assert batched.doc_cache.pass_settings() == (8192, 0)
    alone = _engine(family, kv_tier="pool", document_pass_tokens=0)
    dc = batched.doc_cache
    texts = [t for _, t in DOCS] + ["Short.", "The river Dunmore floods every spring; " * 6]
    ids = [batched.prompts.encode_document(Document(f"d{i}", t)) for i, t in enumerate(texts)]
    got = documents_pass(dc.doc_runner.dec, dc.doc_runner.rope, dc.prefix_kv(), ids)
    for x, kv in zip(ids, got, strict=True):
        full, segs = dc.after_prefix([(x, None)])
        n = int(full.numel())
        ref = dc.doc_runner.prefill(full, segs, Reuse(), 0.0, capture=(n - len(x), n), want_logits=False).captured
        assert kv.k.device.type == "cuda" and kv.k.shape == ref.k.shape
        torch.testing.assert_close(kv.k.float(), ref.k.float(), rtol=0.02, atol=0.05)
        torch.testing.assert_close(kv.v.float(), ref.v.float(), rtol=0.02, atol=0.05)
    kw = dict(strategy="infoflow", recompute_ratio=0.3, max_new_tokens=6)
    a, b = batched.generate(QUESTION, DOCS, **kw), alone.generate(QUESTION, DOCS, **kw)
    assert a.cache_misses == b.cache_misses == len(DOCS) and a.token_ids == b.token_ids


@pytest.mark.parametrize("batched", [True, False], ids=["padded", "per-document"])
@pytest.mark.parametrize("family", ["llama3", "qwen2"])
def test_documents_pass_on_cuda_with_chunks_is_the_same_bits_whatever_the_pass_mates(family, batched):
    """With GEMMs at one shape (`chunk`, `EngineConfig.document_chunk_rows`) a document's cache on CUDA is the same
    bits alone, packed with others and reordered, with either attention path (padded batched, per document): the
    invariance CUDA's default (one GEMM per weight, faster) gives up and the setting buys back."""
    from kvfuse.engine.docpass import documents_pass
    from kvfuse.engine.types import Document

    engine = _engine(family, kv_tier="pool")
    dc = engine.doc_cache
    texts = [t for _, t in DOCS] + ["Short.", "The river Dunmore floods every spring; " * 6, "Voss " * 40]
    ids = [engine.prompts.encode_document(Document(f"d{i}", t)) for i, t in enumerate(texts)]
    seam = (dc.doc_runner.dec, dc.doc_runner.rope, dc.prefix_kv())
    with torch.inference_mode():
        alone = [documents_pass(*seam, [x], chunk=64, batched=batched)[0] for x in ids]
        together = documents_pass(*seam, ids, chunk=64, batched=batched)
        reordered = documents_pass(*seam, ids[::-1], chunk=64, batched=batched)[::-1]
    for a, b, c in zip(alone, together, reordered, strict=True):
        assert torch.equal(a.k, b.k) and torch.equal(a.v, b.v)
        assert torch.equal(a.k, c.k) and torch.equal(a.v, c.v)

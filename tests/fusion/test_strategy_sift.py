"""sift: every token computed, attention restricted by per-document indexes. Full marks equal full prefill; the
block lists follow the index exactly (a hand-built index gives the hand-built mask); low marks really drop
attention; indexes round-trip through bytes and any damage or mismatch is refused; precompute stores indexes only."""
from __future__ import annotations

import pytest
import torch

from kvfuse import Document
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.sift import CrossPick, SiftIndex, sparse_plan

from cases import DOCS, QUESTION

SPARSE = dict(min_tokens=0, max_density=1.0)  # these prompts are tiny: run the sparse kernel whatever it saves

LONG = [("l1", "The western ridge holds three abandoned copper mines, worked from 1820 until the floods of 1871. "
               "Miners walked from Esk each morning along the river path, and the company store sold lamps, rope "
               "and bread. The mines closed when the river changed course and flooded the lower galleries."),
        ("l2", "Larkspur's first director, Mara Quill, was born in Esk and trained as a surveyor before astronomy. "
               "She mapped the ridge, wrote two books on comets, and retired to the coast in 1890 after a long "
               "dispute with the university over the funding of a new telescope dome.")]


def _density(engine, docs, strat) -> float:
    """The attention density a request with these documents reports (`extra["sift"]`)."""
    return engine.generate(QUESTION, docs, strategy=strat, max_new_tokens=1).extra["sift"]["density"]


def test_full_marks_equal_full_prefill(tiny_engine):
    engine = tiny_engine("llama")
    docs = DOCS + LONG
    answer = engine.generate(QUESTION, docs, strategy="full", max_new_tokens=6).token_ids
    full = engine.next_token_logprobs(QUESTION, docs, answer, strategy="full")
    every = make_strategy("sift", **SPARSE, block=4, local_mass=1.0, cross_mass=1.0, on_miss="compute")
    got = engine.next_token_logprobs(QUESTION, docs, answer, strategy=every)
    torch.testing.assert_close(got, full, atol=1e-4, rtol=0)
    sparse = make_strategy("sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3, kernel_block=16,
                           on_miss="compute")
    low = engine.next_token_logprobs(QUESTION, docs, answer, strategy=sparse)
    assert _density(engine, docs, sparse) < 1.0
    assert (low - full).abs().max() > 1e-3  # attention really dropped: the comparison above can fail
    # the same sparse marks with a dense window over the whole prompt: every causal pair again, full's numbers
    wide = make_strategy("sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3, kernel_block=16, on_miss="compute",
                         window=100_000)
    torch.testing.assert_close(engine.next_token_logprobs(QUESTION, docs, answer, strategy=wide), full,
                               atol=1e-4, rtol=0)
    assert _density(engine, docs, wide) == 1.0


def test_generation_reports_indexes_and_reuses_them(tiny_engine):
    engine = tiny_engine("llama")
    kw = dict(strategy="sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3, max_new_tokens=3)
    r1 = engine.generate(QUESTION, DOCS + LONG, on_miss="compute", **kw)
    r2 = engine.generate(QUESTION, DOCS + LONG, on_miss="compute", **kw)
    assert r1.extra["sift"]["index_computed"] == 5 and r2.extra["sift"]["index_hits"] == 5
    assert r1.token_ids == r2.token_ids and 0 < r2.extra["sift"]["density"] < 1.0
    assert r1.recomputed_tokens == r1.doc_tokens  # every token computed


def test_new_documents_attend_densely_and_get_their_index_when_the_engine_is_idle(tiny_engine):
    engine = tiny_engine("llama")
    docs = DOCS + LONG
    kw = dict(strategy="sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3, max_new_tokens=4)
    full = engine.generate(QUESTION, docs, strategy="full", max_new_tokens=4)
    first = engine.generate(QUESTION, docs, **kw)  # on_miss="dense", the default: no index on the request's path
    rep = first.extra["sift"]
    assert (rep["index_deferred"], rep["index_computed"], rep["index_hits"]) == (5, 0, 0)
    assert rep["density"] == 1.0 and first.token_ids == full.token_ids  # dense: a full prefill's answer
    assert engine.wait_for_indexes(timeout=60) and engine.deferred_indexes == 0
    assert len(engine.sift_indexes) == 5  # built between requests, by the scheduler
    again = engine.generate(QUESTION, docs, **kw)
    assert again.extra["sift"]["index_hits"] == 5 and again.extra["sift"]["index_deferred"] == 0
    assert again.extra["sift"]["density"] < 1.0
    with pytest.raises(ValueError, match="on_miss"):
        make_strategy("sift", on_miss="later")


def test_precompute_stores_indexes_not_caches(tiny_engine):
    engine = tiny_engine("llama")
    entries = engine.cache_stats()["memory_entries"]
    rep = engine.precompute(DOCS + LONG, strategy="sift")
    assert rep.misses == 5 and len(engine.sift_indexes) == 5
    assert engine.cache_stats()["memory_entries"] <= entries + 1  # the shared prompt prefix only: no document entry
    assert engine.precompute(DOCS + LONG, strategy="sift").hits == 5


def test_indexes_are_built_in_one_pass_each_the_documents_own(tiny_engine, monkeypatch):
    """A precompute slice's (and an on_miss="compute" request's) missing indexes are built in one pass; each is bit
    for bit the index of its document built alone (GEMMs of one shape on the CPU), and marks the blocks the old
    one-prefill-per-document build marked, up to blocks at a threshold."""
    from kvfuse.engine import api
    from kvfuse.engine.sift import compute_indexes

    engine = tiny_engine("llama")
    ids = [engine.prompts.encode_document(Document(*d)) for d in DOCS + LONG]
    together = compute_indexes(engine, ids, block=4, local_mass=0.5, cross_mass=0.3)
    agree, total = 0, 0
    for x, idx in zip(ids, together, strict=True):
        alone = compute_indexes(engine, [x], block=4, local_mass=0.5, cross_mass=0.3)[0]
        assert torch.equal(idx.local, alone.local) and torch.equal(idx.cross, alone.cross) and idx.n_tokens == len(x)
        old = compute_indexes(engine, [x], block=4, local_mass=0.5, cross_mass=0.3, max_tokens=0, chunk=0)[0]
        agree += int((old.local == idx.local).sum() + (old.cross == idx.cross).sum())
        total += old.local.numel() + old.cross.numel()
    assert agree / total > 0.98
    low = compute_indexes(engine, ids[:1], block=4, local_mass=0.2, cross_mass=0.1)[0]
    assert not torch.equal(low.local, together[0].local)  # the marks follow the attention: the checks can fail

    calls = []
    real = api.compute_indexes
    monkeypatch.setattr(api, "compute_indexes", lambda e, docs, *a, **k: calls.append(len(docs)) or real(e, docs, *a,
                                                                                                          **k))
    fresh = tiny_engine("llama")
    rep = fresh.precompute(DOCS + LONG + [DOCS[0]], strategy="sift")
    assert calls == [5] and (rep.misses, rep.hits) == (5, 1)
    other = tiny_engine("llama")
    r = other.generate(QUESTION, DOCS + LONG, strategy="sift", on_miss="compute", **SPARSE, block=4, local_mass=0.5,
                       cross_mass=0.3, max_new_tokens=2)
    assert calls == [5, 5] and r.extra["sift"]["index_computed"] == 5
    again = other.generate(QUESTION, DOCS + LONG, strategy="sift", on_miss="compute", **SPARSE, block=4,
                           local_mass=0.5, cross_mass=0.3, max_new_tokens=2)
    assert calls == [5, 5] and again.extra["sift"]["index_hits"] == 5


def _index(n_layers, nb, block, n_tokens, local_rows, cross):
    local = torch.zeros(n_layers, nb, nb, dtype=torch.bool)
    for q, ks in local_rows.items():
        local[:, q, ks] = True
    cr = torch.zeros(n_layers, nb, dtype=torch.bool)
    cr[:, cross] = True
    return SiftIndex(block, n_tokens, local, cr)


def test_block_lists_follow_the_index():
    # prompt: prefix [0, 4), doc A [4, 20) (4 local blocks of 4), doc B [20, 36), tail [36, 40); kernel blocks of 4
    a = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [0, 2], 3: [3]}, [1])
    b = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [2], 3: [1, 3]}, [0])
    lists, counts, density = sparse_plan(40, 1, [(4, 20, a), (20, 36, b)], 4, "cpu")
    m = torch.zeros(10, 10, dtype=torch.bool)
    for qb in range(10):
        for kb in lists[0][qb, :counts[0][qb]].tolist():
            m[qb, kb] = True
    want = torch.zeros(10, 10, dtype=torch.bool)
    want[:, 0] = True  # the prefix (a dense block) is seen by everyone
    want[0, 0] = want[9, :] = True  # the prefix and the tail attend densely
    for qb in range(1, 10):
        want[qb, qb] = want[qb, qb - 1] = True  # local window
    want[3, 1] = True  # doc A's block 2 marks its block 0 (kernel block 1)
    want[8, 6] = True  # doc B's block 3 marks its block 1 (kernel block 6)
    want[4:, 2] = True  # doc A's cross mark (its block 1 = kernel block 2) seen from its last block on
    want[8:, 5] = True  # doc B's cross mark (kernel block 5) from its last block on
    want &= torch.tril(torch.ones(10, 10, dtype=torch.bool))
    assert torch.equal(m, want), (m.int(), want.int())
    assert 0 < density < 1
    # no index: that document's rows attend densely
    lists, counts, _ = sparse_plan(40, 1, [(4, 20, None), (20, 36, b)], 4, "cpu")
    assert counts[0][1:5].tolist() == [2, 3, 4, 5]


def _mask(lists, counts, nb):
    m = torch.zeros(nb, nb, dtype=torch.bool)
    for qb in range(nb):
        m[qb, lists[0][qb, :counts[0][qb]]] = True
    return m


def test_a_dense_local_window_adds_exactly_the_blocks_it_reaches():
    # the same prompt as above: a window of 12 tokens (3 kernel blocks of 4) back from each query block's first row
    a = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [0, 2], 3: [3]}, [1])
    b = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [2], 3: [1, 3]}, [0])
    base = _mask(*sparse_plan(40, 1, [(4, 20, a), (20, 36, b)], 4, "cpu")[:2], 10)
    for window, reach in ((0, 1), (4, 1), (5, 2), (12, 3)):
        lists, counts, density = sparse_plan(40, 1, [(4, 20, a), (20, 36, b)], 4, "cpu", window=window)
        m = _mask(lists, counts, 10)
        band = torch.tril(torch.ones(10, 10, dtype=torch.bool)) & ~torch.tril(torch.ones(10, 10, dtype=torch.bool),
                                                                             diagonal=-reach - 1)
        assert torch.equal(m, base | band), (window, m.int())
    assert density > sparse_plan(40, 1, [(4, 20, a), (20, 36, b)], 4, "cpu")[2]
    with pytest.raises(ValueError, match="window"):
        make_strategy("sift:window=-1")


def test_index_bytes_round_trip_and_refuse_damage():
    idx = _index(3, 4, 4, 14, {0: [0], 1: [0, 1], 2: [2], 3: [1, 3]}, [0, 2])
    key = "ab" * 32
    data = idx.to_bytes(key)
    back = SiftIndex.from_bytes(data, key, 3, 14)
    assert back is not None and torch.equal(back.local, idx.local) and torch.equal(back.cross, idx.cross)
    assert SiftIndex.from_bytes(data, "cd" * 32, 3, 14) is None  # another document / model / prefix
    assert SiftIndex.from_bytes(data, key, 4, 14) is None  # another model depth
    assert SiftIndex.from_bytes(data, key, 3, 15) is None  # another length
    for at in (0, 10, 80, len(data) // 2, len(data) - 1):
        bad = bytearray(data)
        bad[at] ^= 0x01
        assert SiftIndex.from_bytes(bytes(bad), key, 3, 14) is None
    assert SiftIndex.from_bytes(data[:-5], key, 3, 14) is None
    assert SiftIndex.from_bytes(b"", key, 3, 14) is None and SiftIndex.from_bytes("text", key, 3, 14) is None


def _plan_reference(n, n_layers, docs, block):
    """The block masks by the rules, block pair by block pair (the oracle of the vectorised `sparse_plan`)."""
    nb = -(-n // block)
    first = min((s for s, _, _ in docs), default=n)
    last = max((e for _, e, _ in docs), default=n)
    out = torch.zeros(n_layers, nb, nb, dtype=torch.bool)
    tok_blk = lambda t: t // block  # noqa: E731
    for layer in range(n_layers):
        for qb in range(nb):
            for kb in range(qb + 1):
                rows = range(qb * block, min(n, (qb + 1) * block))
                keys = range(kb * block, min(n, (kb + 1) * block))
                ok = kb >= qb - 1  # window
                ok |= any(r < first or r >= last for r in rows)  # prefix / tail rows attend densely
                ok |= any(k < first for k in keys)  # everyone sees the prefix
                for s, e, idx in docs:
                    mine = [r for r in rows if s <= r < e]
                    if not mine:
                        continue
                    if idx is None:
                        ok = True
                        continue
                    for r in mine:  # its own marked blocks
                        lq = (r - s) // idx.block
                        ok |= any(idx.local[layer, lq, (k - s) // idx.block] for k in keys if s <= k < e)
                for s, e, idx in docs:  # earlier documents' cross marks, from their last block on
                    if idx is None or qb < tok_blk(e - 1):
                        continue
                    ok |= any(idx.cross[layer, (k - s) // idx.block] for k in keys if s <= k < e)
                out[layer, qb, kb] = ok
    return out


def test_vectorised_plan_matches_the_rules_on_random_indexes():
    g = torch.Generator().manual_seed(3)
    # prefix [0, 5), doc [5, 27) (local block 4), glue [27, 30), doc [30, 61) (local block 8), no-index doc
    # [61, 70), tail [70, 77); kernel blocks of 8: documents start and end inside kernel blocks
    spans = [(5, 27, 4), (30, 61, 8), (61, 70, None)]
    docs = []
    for s, e, b in spans:
        if b is None:
            docs.append((s, e, None))
            continue
        nbl = -(-(e - s) // b)
        local = torch.tril(torch.rand(3, nbl, nbl, generator=g) < 0.35)
        cross = torch.rand(3, nbl, generator=g) < 0.3
        docs.append((s, e, SiftIndex(b, e - s, local, cross)))
    lists, counts, density = sparse_plan(77, 3, docs, 8, "cpu")
    want = _plan_reference(77, 3, docs, 8)
    for layer in range(3):
        got = torch.zeros_like(want[layer])
        for qb in range(want.shape[1]):
            row = lists[layer][qb, :counts[layer][qb]].tolist()
            assert row == sorted(row) and qb in row
            got[qb, row] = True
        assert torch.equal(got, want[layer]), (layer, got.int(), want[layer].int())
    nb = want.shape[1]
    assert density == pytest.approx(float(want.sum()) / (3 * nb * (nb + 1) / 2))
    assert density < 1.0
    # a plan denser than max_density is counted, not built (the request will attend densely)
    for mode in ("marks", "pick"):
        assert sparse_plan(77, 3, docs, 8, "cpu", cross=mode, max_density=density - 1e-6) == (None, None, density)
        kept, _, same = sparse_plan(77, 3, docs, 8, "cpu", cross=mode, max_density=density)
        assert kept is not None and same == density


def test_carried_indexes_are_used_and_bad_ones_refused(tiny_engine, monkeypatch):
    engine = tiny_engine("llama")
    docs = DOCS + LONG
    sparse = dict(strategy="sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3, on_miss="compute")
    report, blobs = engine.precompute_indexes(docs, "sift:block=4:local_mass=0.5:cross_mass=0.3")
    assert (report.misses, report.hits) == (len(docs), 0)  # one pass computed them all
    assert all(isinstance(b, bytes) and 100 < len(b) < 4096 for b in blobs)
    again, same = engine.precompute_indexes(docs, "sift:block=4:local_mass=0.5:cross_mass=0.3")
    assert (again.hits, again.misses) == (len(docs), 0) and same == blobs
    assert engine.sift_index_bytes(docs, "sift:block=4:local_mass=0.5:cross_mass=0.3") == blobs
    carried = [Document(d[0], d[1], sift_index=b) for d, b in zip(docs, blobs)]
    fresh = tiny_engine("llama")  # no index store: the carried bytes are all it has
    answer = fresh.generate(QUESTION, docs, strategy="full", max_new_tokens=5).token_ids
    r = fresh.generate(QUESTION, carried, max_new_tokens=3, **sparse)
    assert r.extra["sift"]["index_carried"] == 5 and r.extra["sift"]["index_computed"] == 0
    assert len(fresh.sift_indexes) == 0
    parsed = []
    real = SiftIndex.from_bytes
    monkeypatch.setattr(SiftIndex, "from_bytes", lambda *a, **k: parsed.append(1) or real(*a, **k))
    again = fresh.generate(QUESTION, carried, max_new_tokens=3, **sparse)
    assert again.extra["sift"]["index_carried"] == 5 and parsed == []  # checked once, then served from the memo
    monkeypatch.undo()
    stored = fresh.generate(QUESTION, docs, max_new_tokens=3, **sparse)  # computes the same indexes itself
    assert stored.extra["sift"]["index_computed"] == 5 and stored.token_ids == r.token_ids

    # refused: damaged, truncated, another document's, other index settings; those documents attend densely
    other = fresh.sift_index_bytes(docs, "sift:block=8:local_mass=0.5:cross_mass=0.3")
    flipped = bytearray(blobs[0])
    flipped[len(flipped) // 2] ^= 0x10
    bad = [bytes(flipped), blobs[1][:-7], blobs[0], other[3], b"not an index"]
    refused = [Document(d[0], d[1], sift_index=b) for d, b in zip(docs, bad)]
    r2 = fresh.generate(QUESTION, refused, max_new_tokens=3, **sparse)
    assert r2.extra["sift"]["index_rejected"] == 5 and r2.extra["sift"]["index_carried"] == 0
    full = fresh.next_token_logprobs(QUESTION, docs, answer, strategy="full")
    dense = fresh.next_token_logprobs(QUESTION, refused, answer, strategy=make_strategy(
        "sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3))
    torch.testing.assert_close(dense, full, atol=1e-4, rtol=0)  # every document dense: full prefill
    low = fresh.next_token_logprobs(QUESTION, carried, answer, strategy=make_strategy(
        "sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3))
    assert (low - full).abs().max() > 1e-3  # the intact indexes really are sparse: the check above can fail


def test_a_carried_index_must_be_bytes():
    with pytest.raises(ValueError, match="sift_index must be bytes"):
        Document("d", "text", sift_index="AAAA")
    assert Document("d", "text", sift_index=bytearray(b"ab")).sift_index == b"ab"
    with pytest.raises(ValueError, match="keeps no selective index"):
        from kvfuse.engine.api import FusionEngine
        FusionEngine.sift_index_bytes(object.__new__(FusionEngine), [("d", "t")], "reuse")


def _aimed_at(block: int, n_blocks: int = 10, size: int = 4, d: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [T, 2, d], k [T, 1, d]): each kernel block's keys point one way, and every query at `block`'s keys."""
    k = torch.zeros(n_blocks * size, 1, d)
    for blk in range(n_blocks):
        k[blk * size:(blk + 1) * size, 0, blk % d] = 1.0
    q = torch.zeros(n_blocks * size, 2, d)
    q[:, :, block % d] = 30.0
    return q, k


def test_cross_pick_opens_the_blocks_the_queries_aim_at_as_many_as_the_marks():
    # the prompt of the two tests above; doc A's cross mark is its kernel block 2, doc B's is kernel block 5
    a = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [0, 2], 3: [3]}, [1])
    b = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [2], 3: [1, 3]}, [0])
    docs = [(4, 20, a), (20, 36, b)]
    marks = _mask(*sparse_plan(40, 1, docs, 4, "cpu")[:2], 10)
    pick, counts, density = sparse_plan(40, 1, docs, 4, "cpu", cross="pick")
    assert isinstance(pick, CrossPick) and density == sparse_plan(40, 1, docs, 4, "cpu")[2]
    # every query aims at doc A's kernel block 4 (its last), not the marked block 2
    lists, cnt = pick.layer(0, *_aimed_at(4))
    m = _mask([lists], [cnt], 10)
    assert torch.equal(cnt, counts[0])  # as many blocks per query block as the marks open: the same density
    assert m[7, 4] and not m[7, 2]  # inside doc B, past its window: the aimed-at block replaces the marked one
    assert m[9].all()  # the tail stays dense
    # what the marks hold without their cross part is kept whatever the estimate says
    static = marks.clone()
    static[4:9, 2] = static[8, 5] = False  # the cross marks' blocks past the window (the tail row 9 is dense)
    assert (m | ~static).all()
    with pytest.raises(ValueError, match="cross"):
        make_strategy("sift:cross=oracle")


def test_local_pick_opens_unmarked_blocks_of_the_own_document_within_the_marks_count():
    # the prompt above: doc B covers kernel blocks 5-8; its query block 7 keeps window 6-7 and the prefix 0 (and its
    # local mark, 7, lies in the window), and doc A's cross mark (2) opens one block more; every query aims at
    # B's first block (5)
    a = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [0, 2], 3: [3]}, [1])
    b = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [2], 3: [1, 3]}, [0])
    docs = [(4, 20, a), (20, 36, b)]
    q, k = _aimed_at(5)
    marks_cnt = sparse_plan(40, 1, docs, 4, "cpu")[1][0]
    got = {}
    for local, cross in (("marks", "pick"), ("pick", "pick"), ("pick", "marks")):
        plan, counts, _ = sparse_plan(40, 1, docs, 4, "cpu", cross=cross, local=local)
        lists, cnt = plan.layer(0, q, k)
        assert torch.equal(cnt, marks_cnt) and torch.equal(cnt, counts[0])  # the same density in every mode
        got[local, cross] = _mask([lists], [cnt], 10)
    assert not got["marks", "pick"][7, 5]  # a cross pick never opens the own document's blocks
    assert got["pick", "pick"][7, 5]  # one pool: the cross mark's share goes where the queries aim, in doc B
    assert got["pick", "marks"][7, 2] and not got["pick", "marks"][7, 5]  # the cross marks stay, with their share
    assert got["pick", "pick"][7, [0, 6, 7]].all()  # the window and the prefix stay whatever the estimate says
    with pytest.raises(ValueError, match="local"):
        make_strategy("sift:local=oracle")


def test_picks_per_kv_head_follow_each_heads_own_queries():
    # the prompt above; two KV heads whose keys point the same way per block; KV head 0's queries aim at doc A's
    # kernel block 4, KV head 1's at its block 2
    a = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [0, 2], 3: [3]}, [1])
    b = _index(1, 4, 4, 16, {0: [0], 1: [1], 2: [2], 3: [1, 3]}, [0])
    docs = [(4, 20, a), (20, 36, b)]
    (q0, k1), (q1, _) = _aimed_at(4), _aimed_at(2)
    q, k = torch.cat([q0, q1], 1), torch.cat([k1, k1], 1)  # [T, 4, d]: heads 0-1 read KV head 0, heads 2-3 KV head 1
    shared = sparse_plan(40, 1, docs, 4, "cpu", cross="pick")[0].layer(0, q, k)
    plan, counts, _ = sparse_plan(40, 1, docs, 4, "cpu", cross="pick", heads="kv")
    lists, cnt = plan.layer(0, q, k)
    assert lists.shape[:2] == (2, 10) and cnt.shape == (2, 10)
    assert torch.equal(cnt, counts[0].expand(2, -1))  # each head as many blocks as the shared list: same density
    per_head = [_mask([lists[h]], [cnt[h]], 10) for h in range(2)]
    assert per_head[0][7, 4] and not per_head[0][7, 2]  # inside doc B past its window: each head its own block
    assert per_head[1][7, 2] and not per_head[1][7, 4]
    one = _mask([shared[0]], [shared[1]], 10)
    assert one[7, 2] != one[7, 4]  # the shared list holds one of the two for both heads
    assert (per_head[0] | per_head[1] | ~one).all() and not torch.equal(per_head[0], per_head[1])
    with pytest.raises(ValueError, match="heads"):
        make_strategy("sift:heads=q")
    with pytest.raises(ValueError, match='heads="kv".*pick'):
        make_strategy("sift:heads=kv:cross=marks")


def test_cross_pick_with_every_block_open_equals_full_prefill(tiny_engine):
    engine = tiny_engine("llama")
    docs = DOCS + LONG
    answer = engine.generate(QUESTION, docs, strategy="full", max_new_tokens=6).token_ids
    full = engine.next_token_logprobs(QUESTION, docs, answer, strategy="full")
    every = make_strategy("sift", **SPARSE, block=4, local_mass=1.0, cross_mass=1.0, on_miss="compute", cross="pick")
    torch.testing.assert_close(engine.next_token_logprobs(QUESTION, docs, answer, strategy=every), full,
                               atol=1e-4, rtol=0)
    kw = dict(block=4, local_mass=0.5, cross_mass=0.3, kernel_block=16, on_miss="compute", **SPARSE)
    marks = engine.next_token_logprobs(QUESTION, docs, answer, strategy=make_strategy("sift", cross="marks", **kw))
    picked = make_strategy("sift", **kw)  # cross="pick", the default
    got = engine.next_token_logprobs(QUESTION, docs, answer, strategy=picked)
    assert _density(engine, docs, picked) < 1.0
    assert (got - marks).abs().max() > 1e-4  # other blocks than the marks' were attended
    every_kv = make_strategy("sift", **SPARSE, block=4, local_mass=1.0, cross_mass=1.0, on_miss="compute",
                             cross="pick", local="pick", heads="kv")
    torch.testing.assert_close(engine.next_token_logprobs(QUESTION, docs, answer, strategy=every_kv), full,
                               atol=1e-4, rtol=0)  # lists per KV head with every block open: full prefill
    per_head = make_strategy("sift", heads="kv", **kw)
    got_kv = engine.next_token_logprobs(QUESTION, docs, answer, strategy=per_head)
    assert _density(engine, docs, per_head) == _density(engine, docs, picked)  # as many blocks, per KV head
    assert (got_kv - got).abs().max() > 1e-4


def test_sift_attends_densely_where_the_sparse_kernel_would_not_pay(tiny_engine):
    engine = tiny_engine("llama")
    full = engine.generate(QUESTION, DOCS, strategy="full", max_new_tokens=4)
    # the default bound: 4 x the hidden size; this prompt is shorter, so no index is looked up and nothing is sparse
    assert engine.layout(QUESTION, DOCS).n < 4 * engine.decoder.spec.hidden
    short = engine.generate(QUESTION, DOCS, strategy="sift", on_miss="compute", max_new_tokens=4)
    rep = short.extra["sift"]
    assert rep["sparse"] is False and "min_tokens" in rep["dense_reason"] and rep["density"] == 1.0
    assert rep["index_computed"] == 0 and len(engine.sift_indexes) == 0 and short.token_ids == full.token_ids
    docs = DOCS + LONG
    n = engine.layout(QUESTION, docs).n
    # long enough, but the plan keeps more of the attention than max_density: dense, the plan's density reported
    kw = dict(block=4, local_mass=0.5, cross_mass=0.3, on_miss="compute", min_tokens=n, max_new_tokens=4)
    dense = engine.generate(QUESTION, docs, strategy="sift", max_density=0.05, **kw).extra["sift"]
    assert dense["sparse"] is False and "max_density" in dense["dense_reason"] and dense["density"] == 1.0
    assert 0.05 < dense["plan_density"] < 1.0 and dense["index_computed"] == 5
    sparse = engine.generate(QUESTION, docs, strategy="sift", max_density=1.0, **kw).extra["sift"]
    assert sparse["sparse"] is True and sparse["density"] == dense["plan_density"] and sparse["index_hits"] == 5
    with pytest.raises(ValueError, match="max_density"):
        make_strategy("sift", max_density=0.0)
    with pytest.raises(ValueError, match="min_tokens"):
        make_strategy("sift", min_tokens=-1)


def test_a_sift_instance_shared_by_requests_is_never_changed(tiny_engine):
    """Each request's plan lives on its own copy: the instance a caller passes (and may share between requests,
    threads or engines) keeps no plan or report, so no request can read another's."""
    import copy

    engine = tiny_engine("llama")
    strat = make_strategy("sift", **SPARSE, block=4, local_mass=0.5, cross_mass=0.3, kernel_block=16,
                          on_miss="compute")
    before = copy.deepcopy(vars(strat))
    long = engine.generate(QUESTION, DOCS + LONG, strategy=strat, max_new_tokens=2)
    short = engine.generate(QUESTION, DOCS[:1], strategy=strat, max_new_tokens=2)
    chat = engine.chat([{"role": "user", "content": f"{DOCS[0][1]}\n\n{QUESTION}"}], DOCS[:1], strategy=strat,
                       max_new_tokens=2)
    assert vars(strat).keys() == before.keys() and strat.sparse_plan is None
    assert all(vars(strat)[k] == v for k, v in before.items() if k != "sparse_plan")
    assert long.extra["sift"]["sparse"] and long.extra["sift"]["density"] < 1.0
    assert short.extra["sift"]["density"] != long.extra["sift"]["density"]  # each request its own report
    assert chat.extra["documents"] == [DOCS[0][0]] and chat.extra["sift"]["sparse"] is False  # a chat: dense

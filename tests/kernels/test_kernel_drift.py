"""drift_correct: the drift correction's write, triton (interpreter on CPU) vs the torch reference vs a plain loop."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels import drift_correct, drift_correct_reference, drift_correct_triton


def _case(dtype, noncontiguous: bool, seed: int = 0, h: int = 3, d: int = 20):
    """A pool of 40 rows: 0-23 cached document rows, 24-39 scratch rows; 3 documents; 6 computed rows."""
    g = torch.Generator().manual_seed(seed)
    width = 2 * h if noncontiguous else h
    kbase = torch.randn(40, width, d, generator=g).to(dtype)
    vbase = torch.randn(40, width, d, generator=g).to(dtype)
    kpool, vpool = (kbase[:, ::2], vbase[:, ::2]) if noncontiguous else (kbase, vbase)
    k = torch.randn(12, h, d, generator=g).to(dtype)[::2]  # non-contiguous fresh rows
    v = torch.randn(6, h, d, generator=g).to(dtype)
    fresh_base = torch.tensor([2, 5, 9, 11, 17, 30])        # the last is a computed row of no document (e.g. glue)
    fresh_doc = torch.tensor([0, 0, 1, -1, 2, -1])          # 11: a computed row that is not a candidate's
    slot_base = torch.tensor([1, 2, 3, 8, 9, 10, 16, 17, 20, 21])
    slot_doc = torch.tensor([0, 0, 0, 1, 1, 1, 2, 2, 3, 3])  # document 3 has no computed row: keeps its cache
    dst = 24 + torch.arange(10)
    return kbase, vbase, kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst


def _by_hand(kpool, vpool, k, v, fresh_base, fresh_doc, slot_base, slot_doc, dst, alpha):
    """The definition, row by row in float64: what every destination row must hold."""
    out = {}
    for pool, fresh, name in ((kpool, k, "k"), (vpool, v, "v")):
        for s in range(slot_base.numel()):
            doc = int(slot_doc[s])
            rows = [i for i in range(fresh_base.numel()) if int(fresh_doc[i]) == doc]
            drift = torch.zeros(pool.shape[1:], dtype=torch.float64)
            for i in rows:
                drift += fresh[i].double() - pool[int(fresh_base[i])].double()
            drift /= max(1, len(rows))
            out[(name, int(dst[s]))] = pool[int(slot_base[s])].double() + alpha * drift
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("noncontiguous", [False, True])
def test_triton_and_reference_equal_the_definition(dtype, noncontiguous, triton_device):
    kbase, vbase, kpool, vpool, k, v, fb, fd, sb, sd, dst = _case(dtype, noncontiguous)
    alpha = 0.5
    want = _by_hand(kpool, vpool, k, v, fb, fd, sb, sd, dst, alpha)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=1e-2)

    ref_k, ref_v = kbase.clone(), vbase.clone()
    rk, rv = (ref_k[:, ::2], ref_v[:, ::2]) if noncontiguous else (ref_k, ref_v)
    drift_correct_reference(rk, rv, k, v, fb, fd, sb, sd, dst, 4, alpha)

    dev = triton_device
    tk_base, tv_base = kbase.to(dev), vbase.to(dev)
    tk, tv = (tk_base[:, ::2], tv_base[:, ::2]) if noncontiguous else (tk_base, tv_base)
    drift_correct_triton(tk, tv, k.to(dev), v.to(dev), fb.to(dev), fd.to(dev), sb.to(dev), sd.to(dev), dst.to(dev),
                         4, alpha)
    for got_k, got_v in ((rk, rv), (tk.cpu(), tv.cpu())):
        for (name, row), expected in want.items():
            got = (got_k if name == "k" else got_v)[row].double()
            torch.testing.assert_close(got, expected, **tol)
        # every row that is not a destination is untouched: the cached rows read and the scratch rows past them
        for pool, orig in ((got_k, kpool), (got_v, vpool)):
            assert torch.equal(pool[:24], orig[:24]) and torch.equal(pool[34:], orig[34:])
    if noncontiguous:
        assert torch.equal(tk_base[:, 1::2].cpu(), kbase[:, 1::2])


def test_a_wrong_document_or_weight_changes_the_rows(triton_device):
    """The comparison above can fail: a slot moved to another document, or another alpha, gives other rows."""
    kbase, vbase, kpool, vpool, k, v, fb, fd, sb, sd, dst = _case(torch.float32, False, seed=1)
    want = _by_hand(kpool, vpool, k, v, fb, fd, sb, sd, dst, 0.5)
    dev = triton_device
    for fd2, alpha in ((torch.tensor([0, 1, 1, -1, 2, -1]), 0.5), (fd, 0.3)):
        tk, tv = kbase.clone().to(dev), vbase.clone().to(dev)
        drift_correct_triton(tk, tv, k.to(dev), v.to(dev), fb.to(dev), fd2.to(dev), sb.to(dev), sd.to(dev),
                             dst.to(dev), 4, alpha)
        worst = max(float((tk.cpu()[row].double() - exp).abs().max()) for (name, row), exp in want.items()
                    if name == "k")
        assert worst > 1e-3


def test_slots_of_no_document_are_not_written_by_triton(triton_device):
    kbase, vbase, kpool, vpool, k, v, fb, fd, sb, sd, dst = _case(torch.float32, False, seed=2)
    sd = sd.clone()
    sd[4] = -1
    dev = triton_device
    tk, tv = kbase.clone().to(dev), vbase.clone().to(dev)
    drift_correct_triton(tk, tv, k.to(dev), v.to(dev), fb.to(dev), fd.to(dev), sb.to(dev), sd.to(dev), dst.to(dev),
                         4, 0.5)
    assert torch.equal(tk.cpu()[int(dst[4])], kbase[int(dst[4])])
    assert not torch.equal(tk.cpu()[int(dst[3])], kbase[int(dst[3])])


def test_no_computed_rows_copies_the_cache(triton_device):
    kbase, vbase, kpool, vpool, k, v, fb, fd, sb, sd, dst = _case(torch.bfloat16, False, seed=3)
    dev = triton_device
    tk, tv = kbase.clone().to(dev), vbase.clone().to(dev)
    drift_correct_triton(tk, tv, k[:0].to(dev), v[:0].to(dev), fb[:0].to(dev), fd[:0].to(dev), sb.to(dev),
                         sd.to(dev), dst.to(dev), 4, 0.5)
    assert torch.equal(tk.cpu()[dst], kbase[sb]) and torch.equal(tv.cpu()[dst], vbase[sb])


def test_bad_input_is_refused_before_any_write():
    kbase, vbase, kpool, vpool, k, v, fb, fd, sb, sd, dst = _case(torch.float32, False)
    before = kbase.clone()
    with pytest.raises(ValueError, match="fresh_doc"):
        drift_correct(kpool, vpool, k, v, fb, fd[:3], sb, sd, dst, 4, 0.5)
    with pytest.raises(ValueError, match="k and v"):
        drift_correct(kpool, vpool, k[:, :2], v[:, :2], fb, fd, sb, sd, dst, 4, 0.5)
    with pytest.raises(ValueError, match="integers"):
        drift_correct(kpool, vpool, k, v, fb.float(), fd, sb, sd, dst, 4, 0.5)
    with pytest.raises(ValueError, match="n_docs"):
        drift_correct(kpool, vpool, k, v, fb, fd, sb, sd, dst, 0, 0.5)
    assert torch.equal(kbase, before)

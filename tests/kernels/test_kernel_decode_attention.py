"""decode_attention: batched one-query-per-sequence attention through a row map, against dense masked attention
computed per sequence (the torch reference), and the Triton kernel (interpreter on CPU) against both."""
from __future__ import annotations

import pytest
import torch

from kvfuse.kernels.attention import fused_attention_reference
from kvfuse.kernels.decode_attention import decode_attention, decode_attention_reference


def _tables(n, d):
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    ang = torch.outer(torch.arange(n).float(), inv)
    emb = torch.cat([ang, ang], dim=-1)
    return emb.cos(), emb.sin()


def _case(b=3, hq=4, hkv=2, d=16, c=37, rows=200, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(rows, hkv, d, generator=g).to(dtype)
    v = torch.randn(rows, hkv, d, generator=g).to(dtype)
    q = torch.randn(b, hq, d, generator=g).to(dtype)
    row_map = torch.stack([torch.randperm(rows, generator=g)[:c] for _ in range(b)])
    q_pos = torch.randint(0, c, (b,), generator=g)
    cos, sin = _tables(c + 5, d)
    return q, q_pos, k, v, row_map, cos, sin


def _per_sequence(q, q_pos, k, v, row_map, cos, sin, scale):
    """Each sequence alone through fused_attention over its own rows (keys at positions 0..c-1)."""
    outs = []
    c = row_map.shape[1]
    for i in range(q.shape[0]):
        outs.append(fused_attention_reference(q[i:i + 1], q_pos[i:i + 1], k, v, row_map[i], torch.arange(c), cos,
                                              sin, scale))
    return torch.cat(outs)


@pytest.mark.parametrize("shape", [dict(), dict(b=1, c=1), dict(b=5, hq=6, hkv=3, d=8, c=70), dict(hq=2, hkv=2)])
def test_reference_equals_per_sequence_attention(shape):
    case = _case(**shape)
    want = _per_sequence(*case, 0.3)
    got = decode_attention_reference(*case, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_positions_past_the_query_are_ignored():
    q, q_pos, k, v, row_map, cos, sin = _case()
    base = decode_attention_reference(q, q_pos, k, v, row_map, cos, sin, 0.3)
    moved = row_map.clone()
    for i in range(q.shape[0]):  # point every invisible position somewhere else: nothing may change
        moved[i, int(q_pos[i]) + 1:] = 0
    torch.testing.assert_close(decode_attention_reference(q, q_pos, k, v, moved, cos, sin, 0.3), base)
    poisoned_k, poisoned_v = k.clone(), v.clone()  # rows only invisible positions use: NaN must not leak
    only_hidden = set(row_map[0, int(q_pos[0]) + 1:].tolist()) - set(row_map[0, :int(q_pos[0]) + 1].tolist())
    for r in only_hidden:
        poisoned_k[r, :, :] = float("nan")
        poisoned_v[r, :, :] = float("nan")
    out = decode_attention_reference(q[:1], q_pos[:1], poisoned_k, poisoned_v, row_map[:1], cos, sin, 0.3)
    torch.testing.assert_close(out, base[:1])
    visible = row_map.clone()
    visible[0, 0] = (visible[0, 0] + 1) % k.shape[0]  # a visible key changed: the output must change
    assert not torch.allclose(decode_attention_reference(q, q_pos, k, v, visible, cos, sin, 0.3)[0], base[0])


def test_bad_inputs_are_refused():
    q, q_pos, k, v, row_map, cos, sin = _case()
    with pytest.raises(ValueError, match="row_map"):
        decode_attention(q, q_pos, k, v, row_map[:2], cos, sin, 0.3)
    with pytest.raises(ValueError, match="dtype"):
        decode_attention(q.double(), q_pos, k, v, row_map, cos, sin, 0.3)
    with pytest.raises(ValueError, match="cos"):
        decode_attention(q, q_pos, k, v, row_map, cos[:3], sin[:3], 0.3)


@pytest.mark.parametrize("shape", [dict(), dict(b=2, hq=6, hkv=3, d=8, c=70), dict(b=1, c=1)])
def test_triton_matches_reference(shape, triton_device):
    from kvfuse.kernels.decode_attention import decode_attention_triton

    case = [t.to(triton_device) for t in _case(**shape)]
    want = decode_attention_reference(*case, 0.3)
    torch.testing.assert_close(decode_attention_triton(*case, 0.3), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(decode_attention_triton(*case, 0.3, block_n=16, splits=3), want, rtol=1e-4,
                               atol=1e-4)

"""Plain causal attention over fresh, already-rotated keys: the full-prefill path (nothing cached).

``causal_attention(q[T,Hq,D], k[T,Hkv,D], v[T,Hkv,D], scale) -> [T,Hq,D]``: query t sees keys 0..t. This is
exactly what a full prefill computes, so it goes to PyTorch's fused SDPA (cuDNN first, then flash, on CUDA) rather
than to the deferred-RoPE kernel. One rule on every backend: no Triton version is needed.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["causal_attention", "head_major_sdpa", "token_major_sdpa"]

_CUDA_ORDER = [SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION,
               SDPBackend.MATH]
# torch < 2.6 has no priority order: every backend allowed is then its default order
_PRIORITY = {"set_priority": True} if "set_priority" in inspect.signature(sdpa_kernel).parameters else {}


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal self-attention of a whole prompt.

    Args:
        q: [T, Hq, D] queries, RoPE applied.
        k: [T, Hkv, D] keys, RoPE applied.
        v: [T, Hkv, D] values.
        scale: softmax scale.
    Returns:
        [T, Hq, D] in q's dtype.
    """
    hq, hkv = q.shape[1], k.shape[1]
    if hq % hkv:
        raise ValueError(f"q heads ({hq}) must be a multiple of kv heads ({hkv})")
    return token_major_sdpa(q, k, v, scale, is_causal=True)


def token_major_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, is_causal: bool = False,
                     attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """One SDPA call over token-major [T, H, D] tensors (GQA handled), back to [T, Hq, D]."""
    out = head_major_sdpa(q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None], scale,
                          is_causal=is_causal, attn_mask=attn_mask)
    return out[0].transpose(0, 1).contiguous()


def head_major_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, is_causal: bool = False,
                    attn_mask: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over [B, Hq, L, D] queries and [B, Hkv, S, D] keys and values (GQA handled): [B, Hq, L, D]."""
    hq, hkv = q.shape[1], k.shape[1]
    if q.device.type == "cuda" and attn_mask is None:
        # cuDNN's fused kernel first: it takes grouped K/V heads as they are (measured on an H200,
        # benchmarks/layer_pieces.py: 1.7-2x the flash kernel with K/V repeated, at 2k-8k rows)
        with sdpa_kernel(_CUDA_ORDER, **_PRIORITY):
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=hq != hkv)
    if q.device.type == "cuda" and hq != hkv:
        # masked: the fused CUDA kernels want equal head counts; repeating K/V is cheap next to the attention itself
        k = k.repeat_interleave(hq // hkv, dim=1)
        v = v.repeat_interleave(hq // hkv, dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=hq != hkv)

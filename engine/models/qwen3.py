"""Qwen3: RMSNorm over head_dim on q and k, before RoPE."""
from .base import Decoder

__all__ = ["Qwen3Decoder"]


class Qwen3Decoder(Decoder):
    has_qk_norm = True

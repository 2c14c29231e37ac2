"""Qwen2 / Qwen2.5: q/k/v projections carry a bias (read from the weights), otherwise the plain decoder."""
from .base import Decoder

__all__ = ["Qwen2Decoder"]


class Qwen2Decoder(Decoder):
    has_qk_norm = False

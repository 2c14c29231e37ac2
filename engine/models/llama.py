"""Llama and Mistral: the plain decoder (optional attention bias; Llama-3 RoPE scaling via the rotary module)."""
from .base import Decoder

__all__ = ["LlamaDecoder"]


class LlamaDecoder(Decoder):
    has_qk_norm = False

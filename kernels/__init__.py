"""Kernels of kvfuse: attention over fused KV with deferred RoPE, RoPE, row scatter, KV deviation, attention
scores, the drift correction's write.

Each op lives in its own module with a pure-torch reference of the same signature (``<op>_reference``, also the
CPU path) and a Triton version (``<op>_triton``, CUDA). The public op picks one by the rule in
:mod:`kvfuse.kernels.dispatch`. Importing this package never imports triton.

All tensors are token-major: ``[tokens, heads, head_dim]``.
"""
from .attention import fused_attention, fused_attention_reference, fused_attention_triton
from .attn_scores import attention_and_scores, attention_scores, attention_scores_reference, attention_scores_triton
from .deviation import kv_deviation, kv_deviation_reference, kv_deviation_triton
from .drift import drift_correct, drift_correct_reference, drift_correct_triton
from .dispatch import choose_backend
from .rope import apply_rope, apply_rope_reference, apply_rope_triton
from .scatter import scatter_rows, scatter_rows_reference, scatter_rows_triton

__all__ = [
    "apply_rope", "apply_rope_reference", "apply_rope_triton",
    "attention_and_scores", "attention_scores", "attention_scores_reference", "attention_scores_triton",
    "choose_backend",
    "drift_correct", "drift_correct_reference", "drift_correct_triton",
    "fused_attention", "fused_attention_reference", "fused_attention_triton",
    "kv_deviation", "kv_deviation_reference", "kv_deviation_triton",
    "scatter_rows", "scatter_rows_reference", "scatter_rows_triton",
]

"""The decoder every supported family shares, with a per-layer seam.

Weights are taken (not copied) from a loaded Hugging Face model; the forward loop is our own so the runner
decides what happens between projecting q/k/v and finishing a layer. Batch size is always 1 and every
activation is token-major: hidden states `[T, hidden]`, heads `[T, heads, head_dim]`.

Each op mirrors the Hugging Face implementation's order of operations (RMSNorm in fp32, then cast; RoPE in
the activation dtype), so `full` reproduces transformers' logits to rounding.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ...kernels.rmsnorm import rms_norm
from ...kernels.silu_mul import silu_mul

__all__ = ["ArchSpec", "Decoder", "rms_norm"]


@dataclass(frozen=True)
class ArchSpec:
    """Shape facts of a decoder, read once from the model config.

    Attributes:
        n_layers: decoder layers.
        hidden: residual width.
        n_heads / n_kv_heads: query / key-value heads (GQA when they differ).
        head_dim: per-head width.
        rms_eps: RMSNorm epsilon.
        vocab: output vocabulary size.
        max_positions: the model's context window in tokens.
        family: config.model_type.
    """

    n_layers: int
    hidden: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rms_eps: float
    vocab: int
    max_positions: int
    family: str

    @property
    def scale(self) -> float:
        return self.head_dim ** -0.5

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K+V per token over all layers, for 2-byte dtypes times 2 (fp32 callers multiply)."""
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim


def linear_add(h: Tensor, x: Tensor, w: Tensor, b: Tensor | None = None) -> Tensor:
    """`h + x @ w.T (+ b)`, the residual add after a projection, as a GEMM and then an add kernel.

    Doing the add in the GEMM's epilogue instead (`torch.addmm(h, x, w.t())`) saves one pass over the residual
    stream, but on the H200 it measured no faster over a whole prefill (0.98-1.03x; `benchmarks/residual_epilogue.py`
    runs both side by side), so the plain form stays."""
    return h + F.linear(x, w, b)


def _pack(modules) -> tuple[Tensor, Tensor | None] | None:
    """One weight (and bias) holding the modules' rows in order; each module's weight becomes a view of it, so the
    model keeps one copy. None when their biases are mixed (some present, some not) or their devices or dtypes differ.
    """
    ws = [m.weight for m in modules]
    bs = [m.bias for m in modules]
    if len({(w.device, w.dtype, w.shape[1]) for w in ws}) != 1 or len({b is None for b in bs}) != 1:
        return None
    packed = _adjacent(ws)  # packed before (another engine over the same model): that pack, not a second copy
    if packed is None:
        packed = torch.cat([w.detach() for w in ws])
    bias = None if bs[0] is None else _adjacent(bs)
    if bs[0] is not None and bias is None:
        bias = torch.cat([b.detach() for b in bs])
    o = 0
    for m in modules:
        n = m.weight.shape[0]
        m.weight.data = packed[o:o + n]
        if bias is not None:
            m.bias.data = bias[o:o + n]
        o += n
    return packed, bias


def _adjacent(ts) -> Tensor | None:
    """One tensor over `ts` when they are already consecutive rows of one contiguous storage (as `_pack` leaves
    them), else None."""
    first = ts[0]
    if not all(t.is_contiguous() for t in ts) or len({t.untyped_storage().data_ptr() for t in ts}) != 1:
        return None
    offset = first.storage_offset()
    for t in ts:
        if t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in ts)
    return first.detach().as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


class _Layer:
    """References to one decoder layer's weights (no copies).

    q/k/v and gate/up are also held packed (`wqkv`, `bqkv`, `w_gu`: one GEMM each instead of three and two); the
    separate names are views of the packed rows. `repack` rebuilds the packs after a weight was replaced.
    """

    def __init__(self, hf_layer, with_qk_norm: bool) -> None:
        a, m = hf_layer.self_attn, hf_layer.mlp
        qkv, gu = _pack([a.q_proj, a.k_proj, a.v_proj]), _pack([m.gate_proj, m.up_proj])
        self.ln1 = hf_layer.input_layernorm.weight
        self.ln2 = hf_layer.post_attention_layernorm.weight
        self.wq, self.bq = a.q_proj.weight, a.q_proj.bias
        self.wk, self.bk = a.k_proj.weight, a.k_proj.bias
        self.wv, self.bv = a.v_proj.weight, a.v_proj.bias
        self.wo, self.bo = a.o_proj.weight, a.o_proj.bias
        self.q_norm = a.q_norm.weight if with_qk_norm else None
        self.k_norm = a.k_norm.weight if with_qk_norm else None
        self.w_gate, self.w_up, self.w_down = m.gate_proj.weight, m.up_proj.weight, m.down_proj.weight
        self.wqkv, self.bqkv = qkv if qkv is not None else (None, None)
        self.w_gu = gu[0] if gu is not None else None

    def repack(self, qkv: bool = True, gu: bool = True) -> None:
        """Rebuilds the packed weights from the separate ones after one was replaced; the separate names become views
        of the new pack again, so the layer keeps one copy of its weights."""
        if qkv and self.wqkv is not None:
            self.wqkv = torch.cat([self.wq, self.wk, self.wv])
            self.wq, self.wk, self.wv = self.wqkv.split([self.wq.shape[0], self.wk.shape[0], self.wv.shape[0]])
            if self.bqkv is not None:
                self.bqkv = torch.cat([self.bq, self.bk, self.bv])
                self.bq, self.bk, self.bv = self.bqkv.split([self.bq.shape[0], self.bk.shape[0], self.bv.shape[0]])
        if gu and self.w_gu is not None:
            self.w_gu = torch.cat([self.w_gate, self.w_up])
            self.w_gate, self.w_up = self.w_gu.split([self.w_gate.shape[0], self.w_up.shape[0]])


_ACTIVATIONS = {"silu": F.silu, "swish": F.silu, "gelu": F.gelu}


class Decoder:
    """A RoPE decoder run one layer at a time.

    Subclasses (one per family) only state what differs: `has_qk_norm`.

    Args:
        hf_model: a loaded `*ForCausalLM` of a supported family.
    """

    has_qk_norm = False

    def __init__(self, hf_model) -> None:
        cfg = hf_model.config
        self.config = cfg
        body = hf_model.model
        n_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // n_heads
        self.spec = ArchSpec(
            n_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, n_heads=n_heads,
            n_kv_heads=cfg.num_key_value_heads or n_heads, head_dim=head_dim, rms_eps=cfg.rms_norm_eps,
            vocab=hf_model.lm_head.weight.shape[0], max_positions=cfg.max_position_embeddings,
            family=cfg.model_type)
        act = getattr(cfg, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        self.act = _ACTIVATIONS[act]
        self.embed = body.embed_tokens.weight
        self.layers = [_Layer(layer, self.has_qk_norm) for layer in body.layers[: cfg.num_hidden_layers]]
        self.norm = body.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.rotary = body.rotary_emb
        self.dtype = self.embed.dtype
        self.device = self.embed.device

    # -- the seam ---------------------------------------------------------------------------------------
    links: Tensor | None = None  # [K, hidden] learned rows for the ids vocab .. vocab + K - 1 (engine/links.py)

    def embed_tokens(self, ids: Tensor) -> Tensor:
        """ids [T] -> hidden [T, hidden]. With `links` set, id vocab + j is link row j (no host read: graph-safe)."""
        links = self.links
        if links is None:
            return F.embedding(ids, self.embed)
        vocab = self.spec.vocab
        h = F.embedding(ids.clamp(max=vocab - 1), self.embed)
        slot = (ids - vocab).clamp(0, links.shape[0] - 1)
        return torch.where((ids >= vocab)[:, None], links.index_select(0, slot).to(h.dtype), h)

    def project(self, i: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Layer i's input norm and q/k/v projections, before RoPE.

        Args:
            h: residual stream [T, hidden].
        Returns:
            q [T, n_heads, head_dim], k [T, n_kv_heads, head_dim], v [T, n_kv_heads, head_dim].
        """
        s, w = self.spec, self.layers[i]
        x = rms_norm(h, w.ln1, s.rms_eps)
        if w.wqkv is not None:  # one GEMM; q, k, v are column views of its output
            dq, dkv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
            q, k, v = F.linear(x, w.wqkv, w.bqkv).split([dq, dkv, dkv], dim=-1)
        else:
            q, k, v = F.linear(x, w.wq, w.bq), F.linear(x, w.wk, w.bk), F.linear(x, w.wv, w.bv)
        q = q.view(-1, s.n_heads, s.head_dim)
        k = k.view(-1, s.n_kv_heads, s.head_dim)
        v = v.view(-1, s.n_kv_heads, s.head_dim)
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, s.rms_eps)
            k = rms_norm(k, w.k_norm, s.rms_eps)
        return q, k, v

    def finish(self, i: int, h: Tensor, attn: Tensor) -> Tensor:
        """Layer i after attention: output projection, residual, MLP, residual.

        Args:
            h: the residual stream that entered the layer [T, hidden].
            attn: attention output [T, n_heads, head_dim].
        Returns:
            the next residual stream [T, hidden].
        """
        s, w = self.spec, self.layers[i]
        h = linear_add(h, attn.reshape(attn.shape[0], -1), w.wo, w.bo)
        x = rms_norm(h, w.ln2, s.rms_eps)
        if w.w_gu is not None:  # gate and up in one GEMM, the activation and product in one kernel
            return linear_add(h, silu_mul(F.linear(x, w.w_gu), self.act), w.w_down)
        return linear_add(h, self.act(F.linear(x, w.w_gate)) * F.linear(x, w.w_up), w.w_down)

    def logits(self, h: Tensor) -> Tensor:
        """Final norm and LM head: [T, hidden] -> [T, vocab] (in the model dtype)."""
        return F.linear(rms_norm(h, self.norm, self.spec.rms_eps), self.lm_head)

    # -- RoPE tables ------------------------------------------------------------------------------------
    def rope_tables(self, n_positions: int) -> tuple[Tensor, Tensor]:
        """cos, sin [n_positions, head_dim] in the model dtype, from the model's own rotary module.

        Using the model's module keeps every scaling rule (Llama-3, YaRN attention factor) exactly as
        transformers applies it.
        """
        pos = torch.arange(n_positions, device=self.device).unsqueeze(0)
        probe = torch.empty(1, 1, dtype=self.dtype, device=self.device)
        cos, sin = self.rotary(probe, pos)
        return cos[0], sin[0]

"""The fusion adapter: low-rank deltas (LoRA) on the model's projections, in one of two places (its `stage`).

A cached document is computed alone (after the shared prefix) and later read by requests whose other documents it
never saw. Both kinds are trained by `kvfuse train-adapter` (kvfuse/training) by self-distillation against the base
model's own full prefill, so that the fused answer's distribution moves as little as possible:

- `offline`: acts while a document's cache is computed. The online pass (the prefix, recomputed rows, the question
  and decoding) stays the unmodified base model: online cost is unchanged, but the adapter never sees the other
  documents of a request.
- `online`: acts on the rows a fused prefill computes (the recomputed document rows and the question), the only
  rows that attend across documents; the caches are the base model's and decoding is the base model attending to
  those rows. Served from merged weights (`merge_into`: W + scale * B @ A, one copy of the projections), so a fused
  prefill costs the same as without it.

Either way `full` (and every strategy that reads no cache) is exactly the base model, and the adapter's hash is
part of the cache namespace (`Namespace.adapter`): a cache computed with one adapter (or none) is never served
under another.

File format: safetensors, tensors `layers.{i}.{target}.A` [rank, in] and `layers.{i}.{target}.B` [out, rank], with
metadata `rank`, `alpha`, `targets` (comma separated) and `base` (the base model's namespace fingerprint it was
trained for; informational). Nothing is unpickled.
"""
from __future__ import annotations

import copy
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from .models.base import Decoder, rms_norm

__all__ = ["TARGETS", "STAGES", "FusionAdapter", "AdaptedDecoder", "load_adapter", "merge_into", "packaged_adapter",
           "resolve_adapter"]

#: where an adapter acts: the offline document pass, or the rows a fused prefill computes online
STAGES = ("offline", "online")

#: every projection an adapter may act on, with its (in, out) sizes as functions of the ArchSpec and FFN width
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")


def _shapes(dec: Decoder) -> dict[str, tuple[int, int]]:
    s = dec.spec
    ffn = dec.layers[0].w_up.shape[0]
    return {"q": (s.hidden, s.n_heads * s.head_dim), "k": (s.hidden, s.n_kv_heads * s.head_dim),
            "v": (s.hidden, s.n_kv_heads * s.head_dim), "o": (s.n_heads * s.head_dim, s.hidden),
            "gate": (s.hidden, ffn), "up": (s.hidden, ffn), "down": (ffn, s.hidden)}


@dataclass
class FusionAdapter:
    """LoRA weights per layer and target: delta(x) = (alpha / rank) * (x @ A.T) @ B.T.

    Attributes:
        rank / alpha: the LoRA rank and scale numerator.
        targets: the projections adapted (a subset of TARGETS).
        A / B: target -> [n_layers, rank, in] / [n_layers, out, rank].
        meta: free-form string metadata kept in the file (training record, base fingerprint).
        stage: "offline" (documents' caches) or "online" (the rows a fused prefill computes); see the module.
    """

    rank: int
    alpha: float
    targets: tuple[str, ...]
    A: dict[str, Tensor]
    B: dict[str, Tensor]
    meta: dict[str, str] = field(default_factory=dict)
    stage: str = "offline"

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"adapter stage must be one of {STAGES}, got {self.stage!r}")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank

    @classmethod
    def init(cls, dec: Decoder, rank: int = 8, alpha: float = 16.0, targets=TARGETS, seed: int = 0,
             stage: str = "offline") -> FusionAdapter:
        """A fresh adapter for `dec` (fp32): A ~ Kaiming-uniform, B = 0, so it starts as the identity."""
        bad = [t for t in targets if t not in TARGETS]
        if bad or not targets:
            raise ValueError(f"adapter targets must be a non-empty subset of {TARGETS}, got {list(targets)}")
        if rank < 1:
            raise ValueError(f"adapter rank must be >= 1, got {rank}")
        g = torch.Generator().manual_seed(seed)
        shapes, n = _shapes(dec), dec.spec.n_layers
        A, B = {}, {}
        for t in targets:
            i, o = shapes[t]
            bound = (3.0 / i) ** 0.5  # kaiming-uniform for a linear layer of fan-in i (gain 1)
            A[t] = ((torch.rand(n, rank, i, generator=g) * 2 - 1) * bound).to(dec.device)
            B[t] = torch.zeros(n, o, rank, device=dec.device)
        return cls(rank, float(alpha), tuple(targets), A, B, stage=stage)

    def parameters(self) -> list[Tensor]:
        return [*self.A.values(), *self.B.values()]

    def to(self, device=None, dtype=None) -> FusionAdapter:
        conv = {t: x.to(device=device, dtype=dtype) for t, x in self.A.items()}
        return FusionAdapter(self.rank, self.alpha, self.targets, conv,
                             {t: x.to(device=device, dtype=dtype) for t, x in self.B.items()}, dict(self.meta),
                             self.stage)

    def check(self, dec: Decoder) -> None:
        """Raises ValueError when the adapter does not fit `dec`'s shapes."""
        shapes, n = _shapes(dec), dec.spec.n_layers
        for t in self.targets:
            i, o = shapes[t]
            if tuple(self.A[t].shape) != (n, self.rank, i) or tuple(self.B[t].shape) != (n, o, self.rank):
                raise ValueError(f"adapter does not fit this model: {t}.A {tuple(self.A[t].shape)}, "
                                 f"{t}.B {tuple(self.B[t].shape)}; the model needs ({n}, {self.rank}, {i}) and "
                                 f"({n}, {o}, {self.rank})")

    def delta(self, target: str, i: int, x: Tensor) -> Tensor | None:
        """The adapter's output for `target` at layer i (x: [T, in]), in x's dtype; None when not adapted."""
        a = self.A.get(target)
        if a is None:
            return None
        a, b = a[i], self.B[target][i]
        return ((x.to(a.dtype) @ a.T) @ b.T * self.scale).to(x.dtype)

    # -- files -------------------------------------------------------------------------------------------------
    def tensors(self) -> dict[str, Tensor]:
        out = {}
        for t in self.targets:
            for i in range(self.A[t].shape[0]):
                out[f"layers.{i}.{t}.A"] = self.A[t][i].detach().contiguous()
                out[f"layers.{i}.{t}.B"] = self.B[t][i].detach().contiguous()
        return out

    def save(self, path: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {**self.meta, "rank": str(self.rank), "alpha": repr(self.alpha), "targets": ",".join(self.targets),
                "stage": self.stage, "format": "kvfuse-fusion-adapter-1"}
        save_file({k: v.to("cpu", dtype) for k, v in self.tensors().items()}, str(path), metadata=meta)
        return path

    @property
    def digest(self) -> str:
        """sha256 over rank, alpha, targets, stage and every tensor's bytes: the adapter's part of the cache
        namespace (an offline adapter's digest leaves the stage out, as files written before stages existed do)."""
        stage = "" if self.stage == "offline" else f"|{self.stage}"
        h = hashlib.sha256(f"lora|{self.rank}|{self.alpha!r}|{','.join(self.targets)}{stage}".encode())
        for k, v in sorted(self.tensors().items()):
            h.update(k.encode())
            h.update(v.to("cpu", torch.float32).numpy().tobytes())
        return h.hexdigest()


def read_tensor_file(path: str | Path, what: str) -> tuple[dict[str, str], dict[str, Tensor]]:
    """(metadata, tensors) of a safetensors file (nothing unpickled). Raises ValueError naming `what` (e.g.
    "adapter") for a missing or unreadable file."""
    from safetensors import safe_open

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{what} file {str(path)!r} does not exist")
    try:
        with safe_open(str(path), framework="pt") as f:
            return dict(f.metadata() or {}), {k: f.get_tensor(k) for k in f.keys()}
    except Exception as exc:  # noqa: BLE001 - any unreadable file is one clear error
        raise ValueError(f"{str(path)!r} is not a readable {what} file: {exc}") from None


def load_adapter(path: str | Path) -> FusionAdapter:
    """Reads an adapter file (safetensors; nothing unpickled). Raises ValueError for a file that is not one."""
    path = Path(path)
    meta, raw = read_tensor_file(path, "adapter")
    names = list(raw)
    if meta.get("format") != "kvfuse-fusion-adapter-1":
        raise ValueError(f"{str(path)!r} is not a kvfuse fusion adapter (metadata format={meta.get('format')!r})")
    try:
        rank, alpha = int(meta["rank"]), float(meta["alpha"])
        targets = tuple(t for t in meta["targets"].split(",") if t)
        if not targets or any(t not in TARGETS for t in targets):
            raise ValueError(f"targets {targets}")
        stage = meta.get("stage", "offline")
        if stage not in STAGES:
            raise ValueError(f"stage {stage!r}")
        n = 1 + max(int(k.split(".")[1]) for k in names)
        A = {t: torch.stack([raw[f"layers.{i}.{t}.A"] for i in range(n)]) for t in targets}
        B = {t: torch.stack([raw[f"layers.{i}.{t}.B"] for i in range(n)]) for t in targets}
    except (KeyError, ValueError, IndexError, RuntimeError) as exc:
        raise ValueError(f"{str(path)!r} is a malformed adapter file: {exc}") from None
    keep = {k: v for k, v in meta.items() if k not in ("rank", "alpha", "targets", "stage", "format")}
    return FusionAdapter(rank, alpha, targets, A, B, keep, stage)


#: target -> the _Layer attribute holding its weight
_WEIGHT = {"q": "wq", "k": "wk", "v": "wv", "o": "wo", "gate": "w_gate", "up": "w_up", "down": "w_down"}


def merge_into(dec: Decoder, adapter: FusionAdapter) -> Decoder:
    """A copy of `dec` whose adapted projections hold W + scale * B @ A (summed in fp32, stored in the model
    dtype); everything else (embeddings, norms, LM head, unadapted projections) is shared with `dec`. It computes
    what AdaptedDecoder computes, at the base model's cost per row."""
    adapter.check(dec)
    merged = copy.copy(dec)
    merged.layers = []
    for i, layer in enumerate(dec.layers):
        new = copy.copy(layer)
        for t in adapter.targets:
            w = getattr(layer, _WEIGHT[t])
            a = adapter.A[t][i].to(w.device, torch.float32)
            b = adapter.B[t][i].to(w.device, torch.float32)
            setattr(new, _WEIGHT[t], (w.float() + adapter.scale * (b @ a)).to(w.dtype).contiguous())
        new.repack(qkv=bool({"q", "k", "v"} & set(adapter.targets)), gu=bool({"gate", "up"} & set(adapter.targets)))
        merged.layers.append(new)
    return merged


def packaged_adapter_dir() -> Path:
    """The package's folder of shipped adapter files (kvfuse/data/adapters)."""
    folder = Path(__file__).resolve().parent.parent / "kvfuse" / "data" / "adapters"  # source checkout
    if not folder.is_dir():
        folder = Path(__file__).resolve().parent.parent / "data" / "adapters"  # installed: kvfuse/engine -> kvfuse/data
    return folder


def packaged_adapter(model_name: str) -> Path | None:
    """The adapter file shipped in the package for a registry model name, or None."""
    path = packaged_adapter_dir() / f"{model_name}.safetensors"
    return path if path.is_file() else None


def resolve_adapter(value, model_name: str):
    """What `from_pretrained(adapter=...)` and the CLIs' `--adapter` name, before any model work:

    - "auto" (the default): the adapter shipped for `model_name` when there is one (the embedded model's), else None;
    - None or "none": no adapter;
    - "packaged": the shipped one (ValueError when `model_name` has none);
    - a path or a FusionAdapter: itself (a path is read, and refused with a clear error, by `load_adapter`).
    """
    return resolve_packaged(value, model_name, packaged_adapter, "fusion adapter is", "kvfuse train-adapter")


def resolve_packaged(value, model_name: str, packaged, what: str, train: str):
    """"auto" -> `packaged(model_name)` (a Path or None); None or "none" -> None; "packaged" -> the shipped file
    (ValueError naming `what` and the `train` command when there is none); anything else -> itself."""
    if value is None or (isinstance(value, str) and value.lower() == "none"):
        return None
    if isinstance(value, str) and value == "auto":
        return packaged(model_name)
    if isinstance(value, str) and value == "packaged":
        path = packaged(model_name)
        if path is None:
            raise ValueError(f"no {what} shipped for {model_name!r} (train one: {train})")
        return path
    return value


class AdaptedDecoder:
    """`dec` with an adapter in its projections: the same seam (`project`, `finish`, ...) a Runner drives.

    Everything but `project` and `finish` is the base decoder's (weights are shared, not copied)."""

    def __init__(self, dec: Decoder, adapter: FusionAdapter) -> None:
        adapter.check(dec)
        self.base = dec
        self.adapter = adapter

    def __getattr__(self, name):
        return getattr(self.base, name)

    def project(self, i: int, h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        dec, ad = self.base, self.adapter
        s, w = dec.spec, dec.layers[i]
        x = rms_norm(h, w.ln1, s.rms_eps)
        out = []
        for t, wt, bt, heads in (("q", w.wq, w.bq, s.n_heads), ("k", w.wk, w.bk, s.n_kv_heads),
                                 ("v", w.wv, w.bv, s.n_kv_heads)):
            y = F.linear(x, wt, bt)
            d = ad.delta(t, i, x)
            if d is not None:
                y = y + d
            out.append(y.view(-1, heads, s.head_dim))
        q, k, v = out
        if w.q_norm is not None:
            q = rms_norm(q, w.q_norm, s.rms_eps)
            k = rms_norm(k, w.k_norm, s.rms_eps)
        return q, k, v

    def finish(self, i: int, h: Tensor, attn: Tensor) -> Tensor:
        dec, ad = self.base, self.adapter
        s, w = dec.spec, dec.layers[i]
        a = attn.reshape(attn.shape[0], -1)
        o = F.linear(a, w.wo, w.bo)
        d = ad.delta("o", i, a)
        h = h + (o if d is None else o + d)
        x = rms_norm(h, w.ln2, s.rms_eps)
        g, u = F.linear(x, w.w_gate), F.linear(x, w.w_up)
        dg, du = ad.delta("gate", i, x), ad.delta("up", i, x)
        g = g if dg is None else g + dg
        u = u if du is None else u + du
        m = dec.act(g) * u
        y = F.linear(m, w.w_down)
        dd = ad.delta("down", i, m)
        return h + (y if dd is None else y + dd)


def describe(adapter: FusionAdapter | None) -> str:
    """A one-line summary (for logs and reports)."""
    if adapter is None:
        return "none"
    n = sum(x.numel() for x in adapter.parameters())
    return json.dumps({"rank": adapter.rank, "alpha": adapter.alpha, "targets": list(adapter.targets),
                       "stage": adapter.stage, "params": n, "digest": adapter.digest[:16]})

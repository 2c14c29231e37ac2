"""Link rows: a few learned input vectors placed after every cached document of a fused prompt.

A document's cache is computed alone (after the prompt prefix), so its rows never saw the documents before it;
that is what a fused prefill loses against full prefill. KVLink (arXiv 2502.16002) puts a few *link tokens* after
each document and computes them at request time: they attend to the prefix, their own document and every document
before it, and the question and answer attend to them, so they can carry what the cached rows miss. Here the
model is frozen (so `full` stays the exact base model) and only the K link vectors are learned, by the same
self-distillation as the fusion adapter (kvfuse/training/links.py: the teacher is full prefill, the student the
fused path with the links).

Mechanics:
- The K link rows of a request are K placeholder token ids, `vocab + j` for j < K (past every real token, which
  token-id validation keeps below `vocab`), written after each document by `PromptBuilder.build(links=...)`. They
  are computed rows, like a document's title, never cached, and they shift everything after them by K positions
  per document (positions stay exact: every cache is re-positioned anyway).
- The decoder embeds a placeholder id as its learned vector (`attach`: `Decoder.links`), with no host read, so the
  CUDA graphs of the bucketed path replay them like any other row.
- Documents' caches do not change, so links are not part of any cache key; a request's result names them
  (`result.extra["links"]`: rows per document, the rows in all, the digest). They are computed with the request
  but are not the user's text: `prompt_tokens` (and the usage the server reports) leaves them out.
- They apply to the strategies that read documents' caches in place (`applies_to`); `full` and `sift` compute every
  row and never see them, and coinrag's compressed documents are laid out without them.

Files are safetensors (`format` kvfuse-link-rows-1, one tensor `links` [K, hidden]); nothing is unpickled.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import torch
from torch import Tensor

__all__ = ["LinkRows", "load_links", "packaged_links", "resolve_links", "applies_to", "placeholder_ids", "FORMAT"]

FORMAT = "kvfuse-link-rows-1"
MAX_LINKS = 64


@dataclass
class LinkRows:
    """K learned input vectors (`vectors` [K, hidden]) and the file's other metadata (`meta`)."""

    vectors: Tensor
    meta: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        v = self.vectors
        if not isinstance(v, Tensor) or v.ndim != 2 or not 1 <= v.shape[0] <= MAX_LINKS or v.shape[1] < 1:
            shape = tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__
            raise ValueError(f"link rows must be a [K, hidden] tensor with 1 <= K <= {MAX_LINKS}, got {shape}")
        if not v.dtype.is_floating_point or not bool(torch.isfinite(v.detach().float()).all()):
            raise ValueError("link rows must be finite floating-point vectors")

    @property
    def k(self) -> int:
        return int(self.vectors.shape[0])

    @cached_property
    def digest(self) -> str:
        """sha256 of K, hidden and the vectors' float32 bytes (what a result names; computed once: the vectors of a
        LinkRows are not changed after it is made)."""
        v = self.vectors.detach().to("cpu", torch.float32).contiguous()
        h = hashlib.sha256(f"links|{v.shape[0]}|{v.shape[1]}".encode())
        h.update(v.numpy().tobytes())
        return h.hexdigest()

    def check(self, hidden: int) -> None:
        if int(self.vectors.shape[1]) != hidden:
            raise ValueError(f"link rows of width {int(self.vectors.shape[1])} do not fit a model of hidden size "
                             f"{hidden}")

    def save(self, path: str | Path, dtype: torch.dtype = torch.float32) -> Path:
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        meta = {**{k: str(v) for k, v in self.meta.items()}, "format": FORMAT}
        save_file({"links": self.vectors.detach().to("cpu", dtype).contiguous()}, str(path), metadata=meta)
        return path


def load_links(path: str | Path) -> LinkRows:
    """Reads a link-rows file (safetensors; nothing unpickled). Raises ValueError for a file that is not one."""
    from .adapter import read_tensor_file

    path = Path(path)
    meta, raw = read_tensor_file(path, "link rows")
    if meta.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a kvfuse link rows file (metadata format={meta.get('format')!r})")
    vectors = raw.get("links")
    if vectors is None or list(raw) != ["links"]:
        raise ValueError(f"{str(path)!r} is a malformed link rows file: it must hold one tensor, 'links'")
    meta.pop("format")
    return LinkRows(vectors, meta)


def packaged_links(model_name: str) -> Path | None:
    """The link rows file shipped in the package for a registry model name, or None."""
    from .adapter import packaged_adapter_dir

    path = packaged_adapter_dir() / f"{model_name}.links.safetensors"
    return path if path.is_file() else None


def resolve_links(value, model_name: str):
    """What `from_pretrained(links=...)` and the CLIs' `--links` name, before any model work: "auto" (the default:
    the file shipped for `model_name`, else None), None or "none" (no links), "packaged" (the shipped file; ValueError
    when there is none), or a path or a LinkRows (itself; a path is read by `load_links`)."""
    from .adapter import resolve_packaged

    return resolve_packaged(value, model_name, packaged_links, "link rows are", "kvfuse train-links")


def applies_to(strategy) -> bool:
    """Whether a request of `strategy` is laid out with link rows: it reads documents' caches in place."""
    return bool(strategy.uses_cache and not getattr(strategy, "compresses_documents", False)
                and not getattr(strategy, "sparse_index", False))


def placeholder_ids(vocab: int, k: int) -> list[int]:
    """The K placeholder token ids written after each document: vocab, vocab + 1, ..."""
    return [vocab + j for j in range(k)]

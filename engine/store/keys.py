"""Content-addressed cache keys.

key = sha256(namespace, prefix token ids, document token ids). The namespace binds the layout version, the
model fingerprint, the tokenizer fingerprint, the dtype and the fusion adapter's hash, so nothing computed for another model, tokenizer,
precision or cache layout can ever be served. Position is not part of the key: documents are stored at their
local positions and re-positioned exactly at use.
"""
from __future__ import annotations

import array
import functools
import hashlib
import sys
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["LAYOUT_VERSION", "Namespace", "content_key", "fingerprint_tensors"]

LAYOUT_VERSION = 1  # bump whenever DocKV's meaning or serialisation changes


@dataclass(frozen=True)
class Namespace:
    model: str
    tokenizer: str
    dtype: str
    layout: int = LAYOUT_VERSION
    adapter: str = ""  # the fusion adapter's digest (engine/adapter.py); "" for none

    @functools.cached_property
    def digest(self) -> str:
        raw = f"kvfuse|layout={self.layout}|model={self.model}|tok={self.tokenizer}|dtype={self.dtype}"
        if self.adapter:  # caches computed with an adapter live in their own namespace
            raw += f"|adapter={self.adapter}"
        return hashlib.sha256(raw.encode()).hexdigest()


def _ids_bytes(ids: Tensor | list[int]) -> bytes:
    """int64 little-endian bytes of the ids (a list goes through `array`, ~3x faster than a tensor on the host)."""
    if not isinstance(ids, Tensor) and _ARRAY_INT64_LE:
        return array.array("q", ids).tobytes()
    t = torch.as_tensor(ids, dtype=torch.int64).cpu().contiguous()
    return t.numpy().tobytes()


_ARRAY_INT64_LE = array.array("q").itemsize == 8 and sys.byteorder == "little"  # array bytes == the tensor's


@functools.lru_cache(maxsize=64)
def _prefix_hasher(digest: str, prefix: bytes):
    h = hashlib.sha256()
    h.update(digest.encode())
    h.update(len(prefix).to_bytes(8, "little"))
    h.update(prefix)
    return h


def content_key(ns: Namespace, prefix_ids: Tensor | list[int], doc_ids: Tensor | list[int]) -> str:
    """The cache key of a document prefilled after `prefix_ids` (hex sha256)."""
    h = _prefix_hasher(ns.digest, _ids_bytes(prefix_ids)).copy()  # the namespace and prefix part, hashed once
    h.update(_ids_bytes(doc_ids))
    return h.hexdigest()


def fingerprint_tensors(tensors, sample: int = 4096) -> str:
    """A stable fingerprint of model weights: shapes, dtypes and a sample of each tensor's values.

    Reads the first and last `sample` elements of every tensor, so a changed weight file changes the
    fingerprint in practice, without hashing gigabytes.
    """
    h = hashlib.sha256()
    for name, t in tensors:
        flat = t.detach().reshape(-1)
        h.update(f"{name}|{tuple(t.shape)}|{t.dtype}".encode())
        for part in (flat[:sample], flat[-sample:]):
            h.update(part.to(torch.float32).cpu().numpy().tobytes())
    return h.hexdigest()[:32]

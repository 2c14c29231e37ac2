"""One document's cache entry and its file format.

DocKV holds pre-RoPE keys and values of every layer at the document's local positions. On disk an entry is
bytes: an 8-byte magic, a little-endian u32 header length, a JSON header (key, layout version, shapes,
dtype, sha256 of the payload) and a safetensors payload. Loading verifies all of it; nothing is unpickled.
"""
from __future__ import annotations

import hashlib
import hmac
import json
import struct
from dataclasses import dataclass, field

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import Tensor

from .keys import LAYOUT_VERSION

__all__ = ["DocKV", "CorruptEntry", "encode_entry", "decode_entry"]

MAGIC = b"KVFUSE\x00\x01"
_DTYPES = {"torch.float32", "torch.bfloat16", "torch.float16"}


class CorruptEntry(ValueError):
    """A stored entry failed verification (bad magic, header, key, version, shape or checksum)."""


@dataclass
class DocKV:
    """Cached K/V of one document.

    Attributes:
        k: [n_layers, L, n_kv_heads, head_dim] keys before RoPE, at local positions.
        v: [n_layers, L, n_kv_heads, head_dim] values.
        extras: small named tensors stored with the entry (e.g. a strategy's offline token index).
    """

    k: Tensor
    v: Tensor
    extras: dict[str, Tensor] = field(default_factory=dict)
    pool: object | None = None  # the KVPool whose rows [offset, offset + L) k and v are views of
    offset: int = 0

    def __post_init__(self) -> None:
        if self.k.shape != self.v.shape or self.k.dim() != 4:
            raise ValueError(f"DocKV: k {tuple(self.k.shape)} and v {tuple(self.v.shape)} must be equal 4-D")

    @property
    def length(self) -> int:
        return int(self.k.shape[1])

    @property
    def nbytes(self) -> int:
        return self.k.numel() * self.k.element_size() * 2 + sum(t.numel() * t.element_size()
                                                                  for t in self.extras.values())

    def to(self, device) -> DocKV:
        """K/V on `device`; the extras stay in host memory (small index tensors, read by host-side plans such as
        a bucketed prefill's probe view: on the device they would cost a synchronisation per request)."""
        return DocKV(self.k.to(device, non_blocking=True), self.v.to(device, non_blocking=True),
                     {n: t.cpu() for n, t in self.extras.items()})


def _mac(secret: bytes, key: str, digest: str) -> str:
    """HMAC-SHA256 binding an entry's key, layout and payload digest to the cache secret."""
    return hmac.new(secret, f"{key}|{LAYOUT_VERSION}|{digest}".encode(), hashlib.sha256).hexdigest()


def encode_entry(key: str, kv: DocKV, secret: bytes | None = None) -> bytes:
    """The entry's bytes; with `secret`, the header also carries an HMAC that `decode_entry` requires."""
    tensors = {"k": kv.k.contiguous().cpu(), "v": kv.v.contiguous().cpu()}
    tensors.update({f"x.{n}": t.contiguous().cpu() for n, t in kv.extras.items()})
    payload = st_save(tensors)
    digest = hashlib.sha256(payload).hexdigest()
    fields = {"key": key, "layout": LAYOUT_VERSION, "shape": list(kv.k.shape), "dtype": str(kv.k.dtype),
              "sha256": digest}
    if secret:
        fields["mac"] = _mac(secret, key, digest)
    header = json.dumps(fields).encode()
    return MAGIC + struct.pack("<I", len(header)) + header + payload


def decode_entry(key: str, blob: bytes, secret: bytes | None = None) -> DocKV:
    """Parses and verifies an entry written by `encode_entry` for `key`.

    Total over its input: any bytes that are not exactly such an entry raise CorruptEntry, never another error.
    With `secret`, an entry without the HMAC of that secret is refused too: whoever can write the cache folder
    but doesn't hold the secret can't forge an entry (the checksum alone proves integrity, not origin).

    Raises:
        CorruptEntry: on any mismatch.
    """
    if not isinstance(blob, (bytes, bytearray)) or len(blob) < 12 or blob[:8] != MAGIC:
        raise CorruptEntry("bad magic")
    (hlen,) = struct.unpack("<I", blob[8:12])
    if 12 + hlen > len(blob):
        raise CorruptEntry("truncated header")
    try:
        header = json.loads(blob[12:12 + hlen].decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise CorruptEntry(f"unreadable header: {e}") from None
    if not isinstance(header, dict):
        raise CorruptEntry(f"header is a JSON {type(header).__name__}, not an object")
    payload = blob[12 + hlen:]
    if header.get("key") != key:
        raise CorruptEntry("entry belongs to another key")
    if header.get("layout") != LAYOUT_VERSION:
        raise CorruptEntry(f"layout version {header.get('layout')!r} != {LAYOUT_VERSION}")
    shape, dtype = header.get("shape"), header.get("dtype")
    if (not isinstance(shape, list) or len(shape) != 4 or not all(type(n) is int and n >= 0 for n in shape)
            or dtype not in _DTYPES):
        raise CorruptEntry("header shape or dtype is malformed")
    digest = hashlib.sha256(payload).hexdigest()
    if digest != header.get("sha256"):
        raise CorruptEntry("payload checksum mismatch")
    if secret and not (isinstance(header.get("mac"), str)
                       and hmac.compare_digest(header["mac"], _mac(secret, key, digest))):
        raise CorruptEntry("entry not signed with this cache's secret")
    try:
        tensors = st_load(bytes(payload))
    except Exception as e:  # safetensors raises its own error types
        raise CorruptEntry(f"unreadable payload: {e}") from None
    k, v = tensors.get("k"), tensors.get("v")
    if k is None or v is None or list(k.shape) != shape or list(v.shape) != shape or str(k.dtype) != dtype \
            or v.dtype != k.dtype:
        raise CorruptEntry("payload does not match header")
    extras = {n[2:]: t for n, t in tensors.items() if n.startswith("x.")}
    return DocKV(k, v, extras)

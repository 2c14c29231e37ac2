"""One small file per model family; `build_decoder` picks by `config.model_type`."""
from __future__ import annotations

from .base import ArchSpec, Decoder
from .llama import LlamaDecoder
from .qwen2 import Qwen2Decoder
from .qwen3 import Qwen3Decoder

__all__ = ["ArchSpec", "Decoder", "build_decoder", "SUPPORTED_FAMILIES"]

_FAMILIES: dict[str, type[Decoder]] = {
    "llama": LlamaDecoder,
    "mistral": LlamaDecoder,
    "qwen2": Qwen2Decoder,
    "qwen3": Qwen3Decoder,
}
SUPPORTED_FAMILIES = tuple(sorted(_FAMILIES))


def build_decoder(hf_model) -> Decoder:
    """Wraps a loaded transformers causal LM of a supported family.

    Raises:
        ValueError: for an unsupported family or a config kvfuse cannot run exactly (sliding windows).
    """
    cfg = hf_model.config
    family = cfg.model_type
    if family not in _FAMILIES:
        raise ValueError(f"unsupported model family {family!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    layer_types = getattr(cfg, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise ValueError(f"{family}: sliding-window layers are not supported (layer_types={set(layer_types)})")
    return _FAMILIES[family](hf_model)

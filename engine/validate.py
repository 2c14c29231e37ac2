"""Argument checks shared by the engine's entry points.

Each check raises one ValueError whose message names the argument and the problem, so a bad call fails before any
work (tokenization aside) is done. No torch import at module level: `types.py` uses these and stays cheap to import.
"""
from __future__ import annotations

import math
import re
from numbers import Integral, Real
from typing import Any

__all__ = ["lone_surrogate", "check_text", "check_int", "check_real", "check_bool", "check_seed", "check_stop",
           "check_token_ids", "check_doc_id", "check_dir_path",
           "check_redis_url", "check_strategy"]

_SURROGATE = re.compile("[\ud800-\udfff]")
_SEED_RANGE = (-(1 << 63), 1 << 64)  # what torch.Generator.manual_seed accepts: [-2**63, 2**64)


def lone_surrogate(text: str) -> int | None:
    """Index of the first lone surrogate code point in `text` (not encodable as UTF-8), or None."""
    m = _SURROGATE.search(text)
    return None if m is None else m.start()


def check_text(value: Any, what: str, *, allow_empty: bool = False) -> str:
    """`value` must be a str that encodes as UTF-8 (no lone surrogates) and, unless `allow_empty`, is not blank."""
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise ValueError(f"{what} is empty")
    at = lone_surrogate(value)
    if at is not None:
        raise ValueError(f"{what} contains a lone surrogate {value[at]!r} at character {at} (not valid Unicode text)")
    return value


def _is_int(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def check_int(value: Any, what: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """`value` must be an int (not a bool, not a float) within [minimum, maximum]."""
    if not _is_int(value):
        raise ValueError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    value = int(value)
    if minimum is not None and value < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{what} must be <= {maximum}, got {value}")
    return value


def check_real(value: Any, what: str, *, low: float, high: float | None = None, low_open: bool = False) -> float:
    """`value` must be a finite real number (not a bool or a str) in [low, high] ((low, high] with `low_open`)."""
    if not isinstance(value, Real) or isinstance(value, bool):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    x = float(value)
    if not math.isfinite(x):
        raise ValueError(f"{what} must be finite, got {x}")
    if (x <= low if low_open else x < low) or (high is not None and x > high):
        interval = f"{'(' if low_open else '['}{low:g}, {'inf)' if high is None else f'{high:g}]'}"
        raise ValueError(f"{what} must be in {interval}, got {value}")
    return x


def check_bool(value: Any, what: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{what} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_seed(seed: Any) -> int | None:
    """None or an int that torch's generator accepts."""
    if seed is None:
        return None
    if not _is_int(seed) or not _SEED_RANGE[0] <= int(seed) < _SEED_RANGE[1]:
        raise ValueError(f"seed must be None or an int in [-2**63, 2**64), got {type(seed).__name__} {seed!r}")
    return int(seed)


def check_stop(stop: Any) -> list[str]:
    """None -> []; one string -> [it]; a list/tuple of non-empty strings -> a list. Anything else raises."""
    if stop is None:
        return []
    items = [stop] if isinstance(stop, str) else stop
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"stop must be a string or a list of strings, got {type(stop).__name__}")
    out = []
    for i, s in enumerate(items):
        what = "stop" if isinstance(stop, str) else f"stop[{i}]"
        out.append(check_text(s, what, allow_empty=True))
        if not s:
            raise ValueError(f"{what} is an empty string (it would match everywhere)")
    return out


def check_token_ids(ids: Any, what: str, vocab: int | None, *, allow_empty: bool = True,
                    max_len: int | None = None) -> list[int]:
    """A sequence of token ids (list, tuple, range, 1-D integer tensor or array), each an int in [0, vocab) (any
    int >= 0 when `vocab` is None: the vocabulary is checked later), at most `max_len` of them."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__") or isinstance(ids, (dict, set, frozenset)):
        raise ValueError(f"{what} must be a list of token ids, got {type(ids).__name__}")
    if hasattr(ids, "dtype") and hasattr(ids, "tolist"):  # torch tensor / numpy array
        if getattr(ids, "ndim", 1) != 1:
            raise ValueError(f"{what} must be one-dimensional, got shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point if hasattr(ids.dtype, "is_floating_point") else ids.dtype.kind not in "iu":
            raise ValueError(f"{what} must hold integers, got dtype {ids.dtype}")
        ids = ids.tolist()
    out = []
    for i, t in enumerate(ids):
        if not _is_int(t) or int(t) < 0 or (vocab is not None and int(t) >= vocab):
            kind = "a non-negative int" if vocab is None else f"an int in [0, {vocab})"
            raise ValueError(f"{what}[{i}] must be a token id, {kind}, got {type(t).__name__} {t!r}")
        out.append(int(t))
    if not out and not allow_empty:
        raise ValueError(f"{what} is empty")
    if max_len is not None and len(out) > max_len:
        raise ValueError(f"{what} has {len(out)} tokens, more than fit the context window ({max_len})")
    return out


def check_strategy(strategy: Any, options: dict[str, Any]):
    """The fusion strategy by name or instance (`make_strategy`); a wrong type or bad options are one ValueError."""
    from .fusion.base import Strategy, make_strategy

    if not isinstance(strategy, (str, Strategy)):
        raise ValueError(f"strategy must be a strategy name or a Strategy, got {type(strategy).__name__}")
    try:
        return make_strategy(strategy, **options)
    except TypeError as e:
        raise ValueError(f"strategy {getattr(strategy, 'name', strategy)!r}: {e}") from None


def check_doc_id(value: Any, what: str) -> str:
    """A document id given as a str or an int (not a bool): returned as a str."""
    if _is_int(value):
        return str(int(value))
    if not isinstance(value, str):
        raise ValueError(f"{what} must be a string or an int, got {type(value).__name__} {value!r}")
    return value


def check_redis_url(url: Any, what: str) -> str:
    """A Redis server URL (redis://host:port/db, rediss://..., unix:///path); the server is not contacted."""
    from urllib.parse import urlsplit

    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"{what} must be a non-empty string, got {url!r}")
    try:
        parts = urlsplit(url)
        _ = parts.port  # a port that is not a number raises here
    except ValueError:
        raise ValueError(f"{what} is not a URL (redis://host:port/db, rediss://host:port/db, unix:///path)") from None
    if parts.scheme not in ("redis", "rediss", "unix"):
        raise ValueError(f"{what} must start with redis://, rediss:// or unix://, got {parts.scheme or 'no'} scheme")
    if parts.scheme != "unix" and not parts.hostname:
        raise ValueError(f"{what} names no host (redis://host:port/db)")
    if parts.scheme == "unix" and not parts.path:
        raise ValueError(f"{what} names no socket (unix:///path/to/socket)")
    return url


def check_dir_path(path: Any, what: str):
    """A folder path that is a directory or can be created as one: it must not be an existing non-directory, and
    its nearest existing ancestor must be a directory. Returns it as a Path."""
    from pathlib import Path

    p = Path(path)
    if p.exists() and not p.is_dir():
        raise ValueError(f"{what} {str(p)!r} exists and is not a directory")
    for parent in p.absolute().parents:
        if parent.exists():
            if not parent.is_dir():
                raise ValueError(f"{what} {str(p)!r} cannot be created: {str(parent)!r} is not a directory")
            break
    return p


GUARD_AT = ("answer", "probe")


def check_guard_at(value: Any, guard_tokens: Any = None) -> None:
    """`guard_at` (GenerationOptions, EngineConfig): None, "answer" or "probe"; "probe" reads no answer token, so
    it takes no `guard_tokens`."""
    if value is not None and value not in GUARD_AT:
        raise ValueError(f"guard_at must be one of {GUARD_AT}, got {value!r}")
    if value == "probe" and guard_tokens is not None:
        raise ValueError("guard_at='probe' reads the question probe before the fused prefill, no answer token: "
                         f"give no guard_tokens (got {guard_tokens!r})")

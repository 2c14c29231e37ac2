"""`strategy="auto"`: each request's strategy and ratio chosen from the model's measured quality/TTFT front.

A *front* is what `kvfuse eval` measured for one model and adapter: per (strategy, ratio) point its macro fidelity
(F1 of the answer against full prefill's, over the QA sets of the run) and KL, and its TTFT relative to `full`'s
measured side by side, per device type ("cuda", "cpu": the ratios differ a lot between them). `full` is always
on it (fidelity 1, relative TTFT 1). A request asks for one of:

- `target_fidelity=f`: the fastest point whose measured fidelity is >= f (`full` when none is);
- `ttft_budget_s=t`: the most faithful point whose predicted TTFT is <= t (ties: the faster); when none fits, the
  fastest point, with `budget_met` False in `result.extra["auto"]`;
- neither: the front's default point (the best measured at the shipped default cost).

A point may carry a first-token guard (GenerationOptions.guard_margin with guard_tokens=1: a near-tie at the
answer's first token hands the answer to full prefill). Its fidelity is measured like any point's; its relative
TTFT is derived: the unguarded point's plus the share of answers handed over (each such answer pays a full prefill
after the fused one), that share read from the run's recompute fraction. A guard that checks later tokens too is
left off fronts: its mid-answer hand-overs cost a stall in the stream, not TTFT.

Predicted TTFT = relative TTFT x this engine's full-prefill seconds per prompt token x prompt tokens. The rate is
learned from the engine's own requests (every request of a strategy on the front updates it, through that point's
relative TTFT; a moving average), so it follows the user's hardware and load; before any request it is measured
once by a short full prefill (`FusionEngine.calibrate_ttft`). Fronts are plain JSON (never unpickled): the embedded
model's ships in the package (`kvfuse/data/fronts/`); `kvfuse front` builds one from an eval's summary.csv.
"""
from __future__ import annotations

import csv
import json
import math
import threading
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from types import MappingProxyType
from typing import Any, Mapping, Sequence

__all__ = ["AUTO", "FrontPoint", "Front", "Choice", "TtftRate", "packaged_front", "build_front", "quality_from_eval",
           "guarded_from_eval", "rel_ttft_from"]

AUTO = "auto"
GUARD_TAG = "+guard"  # as kvfuse eval labels a guarded run: "<strategy>+guard<M>[/<N>]"
PROBE_GUARD_TAG = "+probeguard"  # ... and one guarded at the question probe (guard_at="probe"): "+probeguard<M>"
FORMAT = "kvfuse-front/1"


@dataclass(frozen=True)
class FrontPoint:
    """One measured operating point. `fidelity` in [0, 1]; `rel_ttft` maps a device type to TTFT / full's TTFT."""

    strategy: str
    ratio: float
    fidelity: float
    kl: float | None = None
    rel_ttft: Mapping[str, float] = field(default_factory=dict)
    guard: float = 0.0  # the guard margin (nats) the point was measured with; 0: none
    guard_tokens: int | None = None  # ... checking the answer's first this many tokens (1 on fronts built here)
    guard_at: str = "answer"  # where the guard read its gap (GenerationOptions.guard_at; "probe": no guard_tokens)

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, str) or not self.strategy or self.strategy == AUTO:
            raise ValueError(f"front point strategy must be a strategy name, got {self.strategy!r}")
        g, gt = self.guard, self.guard_tokens
        if isinstance(g, bool) or not isinstance(g, (int, float)) or not (math.isfinite(g) and g >= 0):
            raise ValueError(f"front point guard must be a margin >= 0 (nats), got {g!r}")
        if gt is not None and (isinstance(gt, bool) or not isinstance(gt, int) or gt < 1 or not g):
            raise ValueError(f"front point guard_tokens must be an int >= 1 beside a guard > 0, got {gt!r}")
        if g and self.strategy == "full":
            raise ValueError("full prefill is never guarded")
        if self.guard_at not in ("answer", "probe") or (self.guard_at == "probe" and (not g or gt is not None)):
            raise ValueError(f"front point guard_at must be 'answer', or 'probe' beside a guard > 0 and no "
                             f"guard_tokens, got {self.guard_at!r}")
        object.__setattr__(self, "guard", float(g))
        for name, v, lo, hi in (("ratio", self.ratio, 0.0, 1.0), ("fidelity", self.fidelity, 0.0, 1.0)):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= float(v) <= hi:
                raise ValueError(f"front point {name} must be in [{lo}, {hi}], got {v!r}")
        rel = dict(self.rel_ttft)
        for dev, r in rel.items():
            if not isinstance(dev, str) or isinstance(r, bool) or not isinstance(r, (int, float)) or not (
                    math.isfinite(r) and r > 0):
                raise ValueError(f"front point rel_ttft must map device types to positive numbers, got {rel!r}")
        object.__setattr__(self, "ratio", float(self.ratio))
        object.__setattr__(self, "fidelity", float(self.fidelity))
        object.__setattr__(self, "rel_ttft", MappingProxyType({k: float(v) for k, v in rel.items()}))

    @property
    def key(self) -> tuple:
        """(strategy, ratio, guard, guard tokens or 0[, "probe"]): unique on a front."""
        k = (self.strategy, round(self.ratio, 4), round(self.guard, 4), self.guard_tokens or 0)
        return k + ("probe",) if self.guard_at == "probe" else k

    def rel(self, device_type: str) -> float | None:
        return 1.0 if self.strategy == "full" else self.rel_ttft.get(device_type)


@dataclass(frozen=True)
class Choice:
    """What auto picked for one request, and why (reported as `result.extra["auto"]`)."""

    strategy: str
    ratio: float
    fidelity: float
    predicted_ttft_s: float | None
    reason: str
    budget_met: bool | None = None
    guard: float = 0.0  # the point's guard margin (nats; 0: none), applied to the request
    guard_tokens: int | None = None
    guard_at: str = "answer"  # where that guard reads its gap (GenerationOptions.guard_at)

    def as_dict(self) -> dict[str, Any]:
        d = {"strategy": self.strategy, "ratio": self.ratio, "fidelity": self.fidelity,
             "predicted_ttft_s": self.predicted_ttft_s, "reason": self.reason, "budget_met": self.budget_met}
        if self.guard:
            d.update(guard_margin=self.guard, guard_tokens=self.guard_tokens, guard_at=self.guard_at)
        return d


@dataclass(frozen=True)
class Front:
    """A model's measured front. `adapter` is the digest prefix (16 hex) of the fusion adapter it was measured
    with, "" for none: a front only describes engines running that adapter."""

    model: str
    adapter: str
    points: tuple[FrontPoint, ...]
    default: tuple[str, float]
    source: str = ""

    def __post_init__(self) -> None:
        pts = [p for p in self.points if p.strategy != "full"]
        keys = [p.key for p in pts]
        if len(set(keys)) != len(keys):
            raise ValueError("a front lists each (strategy, ratio) once")
        full = FrontPoint("full", 1.0, 1.0, 0.0, {})
        object.__setattr__(self, "points", (full, *sorted(pts, key=lambda p: p.key)))
        d = _strategy_key(str(self.default[0]), self.default[1])  # full's ratio is 1 whatever was written
        if d[0] != "full" and (*d, 0.0, 0) not in keys:
            raise ValueError(f"the front's default {d} is not one of its (unguarded) points")
        object.__setattr__(self, "default", d)

    # -- choosing ---------------------------------------------------------------------------------------------
    def usable(self, device_type: str) -> list[FrontPoint]:
        """Points with a relative TTFT for this device type (full always)."""
        return [p for p in self.points if p.rel(device_type) is not None]

    def choose(self, device_type: str, *, target_fidelity: float | None = None, ttft_budget_s: float | None = None,
               full_ttft_s: float | None = None) -> Choice:
        """The point for one request (see the module doc). `full_ttft_s`: the predicted full-prefill TTFT of this
        request (needed with a budget)."""
        pts = self.usable(device_type)
        if target_fidelity is not None and ttft_budget_s is not None:
            raise ValueError("give target_fidelity or ttft_budget_s, not both")

        def predict(p: FrontPoint) -> float | None:
            return None if full_ttft_s is None else p.rel(device_type) * full_ttft_s

        if target_fidelity is not None:
            ok = [p for p in pts if p.fidelity >= target_fidelity]
            best = min(ok, key=lambda p: (p.rel(device_type), -p.fidelity))
            why = (f"fastest measured point with fidelity >= {target_fidelity:.3f}" if best.strategy != "full" else
                   f"no fused point measured at fidelity >= {target_fidelity:.3f}: full prefill")
            return _choice(best, predict(best), why)
        if ttft_budget_s is not None:
            if full_ttft_s is None:
                raise ValueError("a TTFT budget needs a full-prefill TTFT estimate")
            fits = [p for p in pts if predict(p) <= ttft_budget_s]
            if fits:
                best = max(fits, key=lambda p: (p.fidelity, -p.rel(device_type)))
                return _choice(best, predict(best), f"most faithful point predicted within {ttft_budget_s:.3g} s", True)
            best = min(pts, key=lambda p: (p.rel(device_type), -p.fidelity))
            return _choice(best, predict(best), f"no point predicted within {ttft_budget_s:.3g} s: the fastest", False)
        best = next(p for p in self.points if p.key == (*self.default, 0.0, 0))
        return _choice(best, predict(best), "the front's default point")

    # -- files ------------------------------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "model": self.model, "adapter": self.adapter, "source": self.source,
                "default": {"strategy": self.default[0], "ratio": self.default[1]},
                "points": [_point_json(p) for p in self.points if p.strategy != "full"]}

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(json.dumps(self.to_json(), indent=1) + "\n", encoding="utf-8")
        return path

    @classmethod
    def from_json(cls, data: Any, what: str = "front") -> Front:
        """A front from its JSON form; anything malformed is one ValueError naming `what`."""
        try:
            if not isinstance(data, dict) or data.get("format") != FORMAT:
                raise ValueError(f"not a {FORMAT} document")
            pts = tuple(FrontPoint(p["strategy"], p["ratio"], p["fidelity"], p.get("kl"), p.get("rel_ttft", {}),
                                   p.get("guard", 0.0), p.get("guard_tokens"), p.get("guard_at", "answer"))
                        for p in data["points"])
            d = data["default"]
            return cls(str(data["model"]), str(data.get("adapter", "")), pts, (d["strategy"], d["ratio"]),
                       str(data.get("source", "")))
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise ValueError(f"{what}: {e}") from None

    @classmethod
    def load(cls, path: str | Path) -> Front:
        path = Path(path)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"front {path}: cannot be read as JSON ({e})") from None
        return cls.from_json(data, f"front {path}")


def _choice(p: FrontPoint, predicted: float | None, reason: str, budget_met: bool | None = None) -> Choice:
    return Choice(p.strategy, p.ratio, p.fidelity, predicted, reason, budget_met, p.guard, p.guard_tokens,
                  p.guard_at)


def _point_json(p: FrontPoint) -> dict[str, Any]:
    d = {"strategy": p.strategy, "ratio": p.ratio, "fidelity": p.fidelity, "kl": p.kl, "rel_ttft": dict(p.rel_ttft)}
    if p.guard:
        d.update(guard=p.guard, guard_tokens=p.guard_tokens)
    if p.guard_at != "answer":
        d["guard_at"] = p.guard_at
    return d


def packaged_front(model_name: str, adapter: str) -> Front | None:
    """The front shipped for a registry model measured with this adapter (digest prefix, "" for none), or None."""
    folder = resources.files("kvfuse").joinpath("data/fronts")
    if not folder.is_dir():
        return None
    for ref in sorted(folder.iterdir(), key=lambda r: r.name):
        if ref.name.startswith(model_name) and ref.name.endswith(".json"):
            front = Front.from_json(json.loads(ref.read_text(encoding="utf-8")), f"packaged front {ref.name}")
            if front.model == model_name and front.adapter == adapter:
                return front
    return None


def _strategy_key(name: str, ratio: float) -> tuple[str, float]:
    s = name.strip().split("+")[0]  # "infoflow+adapter" in an eval table with an adapter
    return s, (1.0 if s == "full" else round(float(ratio), 4))


def _eval_rows(path: Path) -> list[dict[str, str]]:
    """A `kvfuse eval` summary as rows (summary.csv, or the markdown table of summary.md)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".csv":
        return list(csv.DictReader(text.splitlines()))
    rows = []
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 11 or cells[0] in ("dataset", "") or set(cells[0]) <= set("-:"):
            continue
        num = lambda c: float(c.split()[0].rstrip("%"))  # noqa: E731  "58.6 [52.3, 64.9]" -> 58.6
        rows.append({"dataset": cells[0], "strategy": cells[1], "ratio": cells[2], "fidelity": num(cells[7]) / 100,
                     "kl": num(cells[8]), "ttft_s": num(cells[9]), "recompute_fraction": num(cells[10]) / 100})
    return rows


def _guard_of(label: str) -> tuple[float, int | None, str] | None:
    """(margin, guard tokens, where) of an eval label's "+guard<M>[/<N>]" tag ("infoflow+adapter+guard1/1": the
    answer's first token) or "+probeguard<M>" tag (the question probe), else None."""
    _, sep, tag = label.partition(PROBE_GUARD_TAG)
    if sep:
        return float(tag), None, "probe"
    _, sep, tag = label.partition(GUARD_TAG)
    if not sep:
        return None
    margin, _, tokens = tag.partition("/")
    return float(margin), int(tokens) if tokens else None, "answer"


def _per_dataset(path: Path, guarded: bool = False) -> dict[str, dict[tuple, dict]]:
    """{dataset: {(strategy, ratio): row}} of a summary's unguarded runs; with `guarded`, of its runs guarded at the
    first token only or at the probe, keyed (strategy, ratio, margin, "answer" | "probe")."""
    rows = _eval_rows(path)
    if not rows:
        raise ValueError(f"{path}: no rows")
    by: dict = {}
    for r in rows:
        if "macro" in r["dataset"]:  # a summary's own macro rows: recomputed below from the datasets
            continue
        g = _guard_of(r["strategy"])
        if guarded and g is not None and (g[1] == 1 or g[2] == "probe"):
            by.setdefault(r["dataset"], {})[(*_strategy_key(r["strategy"], r["ratio"]), g[0], g[2])] = r
        elif not guarded and g is None:  # guarded runs are other points (their cost depends on hand-overs)
            by.setdefault(r["dataset"], {})[_strategy_key(r["strategy"], r["ratio"])] = r
    return by


def quality_from_eval(path: str | Path, datasets: list[str] | None = None) -> dict[tuple[str, float], tuple]:
    """(strategy, ratio) -> (fidelity, KL), averaged over the datasets of a `kvfuse eval` summary (each point must
    be on every dataset)."""
    path = Path(path)
    by = _per_dataset(path)
    names = datasets or sorted(by)
    missing = [d for d in names if d not in by]
    if missing:
        raise ValueError(f"{path}: no rows for {missing}")
    keys = set.intersection(*(set(by[d]) for d in names)) - {("full", 1.0)}
    return {k: (sum(float(by[d][k]["fidelity"]) for d in names) / len(names),
                sum(float(by[d][k]["kl"]) for d in names) / len(names)) for k in sorted(keys)}


def guarded_from_eval(path: str | Path, datasets: list[str] | None = None) -> dict[tuple, tuple]:
    """(strategy, ratio, margin, "answer" | "probe") -> (fidelity, KL, hand-over share) of a summary's
    first-token-guarded runs ("+guard<M>/1") and probe-guarded runs ("+probeguard<M>"), averaged over the datasets
    (each point on every one). The hand-over share is read from the recompute fraction beside the unguarded run's:
    an answer handed over recomputes every document token."""
    path = Path(path)
    plain, by = _per_dataset(path), _per_dataset(path, guarded=True)
    names = datasets or sorted(plain)
    out = {}
    for k in sorted(set.intersection(*(set(by.get(d, {})) for d in names))):
        shares = []
        for d in names:
            base = plain[d].get(k[:2])
            fb = float(base["recompute_fraction"]) if base is not None else k[1]
            fg = float(by[d][k]["recompute_fraction"])
            shares.append(min(1.0, max(0.0, (fg - fb) / (1.0 - fb))) if fb < 1 else 0.0)
        out[k] = (sum(float(by[d][k]["fidelity"]) for d in names) / len(names),
                  sum(float(by[d][k]["kl"]) for d in names) / len(names), sum(shares) / len(shares))
    return out


def rel_ttft_from(source: str) -> dict[tuple[str, float], float]:
    """(strategy, ratio) -> TTFT / full's TTFT measured side by side, from a `kvfuse eval` summary (per dataset,
    averaged) or a benchmarks/ttft.py CSV given as "file.csv:shape:context" (its first-sight rows)."""
    path, _, rest = source.partition(":")
    p = Path(path)
    if rest:
        shape, _, ctx = rest.partition(":")
        rows = [r for r in csv.DictReader(p.read_text(encoding="utf-8").splitlines())
                if r["shape"] == shape and r["context"] == ctx and r["tier"] in ("pool", "-")
                and r["row"].endswith("first-sight")]
        times = {}
        for r in rows:
            label = r["row"].removeprefix("kvfuse ").removesuffix(" first-sight")
            name, _, pct = label.partition("@")
            times[_strategy_key(name, float(pct.rstrip("%")) / 100 if pct else 0.0)] = float(r["ttft_ms"])
        if ("full", 1.0) not in times:
            raise ValueError(f"{source}: no 'kvfuse full first-sight' row")
        return {k: t / times[("full", 1.0)] for k, t in times.items() if k != ("full", 1.0)}
    by = _per_dataset(p)
    out: dict = {}
    for rows in by.values():
        if ("full", 1.0) not in rows:
            raise ValueError(f"{source}: every dataset needs a full row")
        for k, r in rows.items():
            if k != ("full", 1.0):
                out.setdefault(k, []).append(float(r["ttft_s"]) / float(rows[("full", 1.0)]["ttft_s"]))
    return {k: sum(v) / len(v) for k, v in out.items()}


def build_front(quality: str | Path, rel: Mapping[str, str | Sequence[str]], *, model: str, adapter: str,
                default: tuple[str, float], datasets: list[str] | None = None,
                guarded: str | Path | Sequence[str | Path] | None = None,
                probe_share: Mapping[str, float] | None = None) -> Front:
    """A front: fidelity and KL from one eval summary, relative TTFT per device type from `rel`
    ({device type: source or sources}, see `rel_ttft_from`; with several, a point takes its figure from the first
    source that measured it). A point without a relative TTFT for a device is not used there. First-token-guarded
    and probe-guarded points come from the `guarded` summary or summaries (default: `quality`; with several, a
    point takes its figures from the first that measured it), see `guarded_from_eval`.

    A guarded point's relative TTFT is derived from its unguarded one, `base`, and the share `s` of answers handed
    over: after the fused prefill (guard_at "answer") a hand-over adds a full prefill, `base + s`; at the probe it
    replaces the fused prefill by the probe and a full prefill, `(1 - s) base + s (p base + 1)`, with `p` the
    probe's share of the strategy's TTFT on that device (`probe_share`, by device type; 1 where not given, which
    is the first formula: an upper bound)."""
    q = quality_from_eval(quality, datasets)
    sources = {dev: [src] if isinstance(src, str) else list(src) for dev, src in rel.items()}
    rels = {}
    for dev, srcs in sources.items():
        rels[dev] = {}
        for src in reversed(srcs):  # the first source wins
            rels[dev].update(rel_ttft_from(src))
    points = tuple(FrontPoint(s, r, fid, kl, {dev: m[(s, r)] for dev, m in rels.items() if (s, r) in m})
                   for (s, r), (fid, kl) in q.items())
    shares = dict(probe_share or {})

    def guarded_rel(base: float, share: float, at: str, dev: str) -> float:
        if at == "answer":  # the unguarded point plus a full prefill for each answer handed over
            return base + share
        return (1 - share) * base + share * (shares.get(dev, 1.0) * base + 1)

    summaries = [guarded or quality] if isinstance(guarded or quality, (str, Path)) else list(guarded)
    measured: dict = {}
    for path in reversed(summaries):  # the first summary that measured a point wins
        measured.update(guarded_from_eval(path, datasets))
    points += tuple(FrontPoint(s, r, fid, kl, {dev: guarded_rel(m[(s, r)], share, at, dev)
                                               for dev, m in rels.items() if (s, r) in m},
                               guard=g, guard_tokens=1 if at == "answer" else None, guard_at=at)
                    for (s, r, g, at), (fid, kl, share) in sorted(measured.items()))
    guards_src = " and ".join(str(p) for p in summaries) if guarded else ""
    source = f"fidelity, KL: {quality}" + (f" (guarded points: {guards_src})" if guarded else "") + \
        "; relative TTFT: " + ", ".join(
        f"{d} {' then '.join(srcs)}" for d, srcs in sources.items())
    return Front(model, adapter, points, _strategy_key(*default), source)


class TtftRate:
    """This engine's full-prefill seconds per prompt token, learned from its own requests (thread-safe)."""

    def __init__(self, weight: float = 0.2) -> None:
        self.weight = weight
        self.value: float | None = None
        self.samples = 0
        self._lock = threading.Lock()

    def observe(self, seconds: float, tokens: int, rel: float | None) -> None:
        """A request's prefill took `seconds` over `tokens` prompt tokens at relative TTFT `rel` (None: not on
        the front, ignored)."""
        if rel is None or tokens <= 0 or not seconds > 0:
            return
        x = seconds / (rel * tokens)
        with self._lock:
            self.value = x if self.value is None else (1 - self.weight) * self.value + self.weight * x
            self.samples += 1

    def predict_full(self, tokens: int) -> float | None:
        return None if self.value is None else self.value * tokens

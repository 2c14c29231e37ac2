"""`kvfuse profile-layers`: find a model's critical layers offline and store them for `qcfuse`.

Every layer is tried alone as the question-attention selector on a few calibration examples (by default the
bundled smoke examples); the layers whose selection brings the fused answer closest to full prefill (lowest KL,
teacher forced over the full answer) are stored as JSON under `<cache dir>/profiles/<model fingerprint>.json`.
"""
from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

__all__ = ["add_profile_parser", "run_profile", "load_examples"]


def load_examples(path: str | None, limit: int) -> list[tuple[str, list[dict]]]:
    """(question, passages) pairs from an evaluation JSONL (default: the bundled smoke examples)."""
    if path is None:
        text = resources.files("kvfuse").joinpath("data/smoke.jsonl").read_text(encoding="utf-8")
    else:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"no such file: {path}")
        text = p.read_text(encoding="utf-8")
    out = []
    for i, line in enumerate(x for x in text.splitlines() if x.strip()):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path or 'smoke.jsonl'}: line {i + 1} is not JSON ({e.msg})") from None
        if not isinstance(rec, dict) or "question" not in rec or not rec.get("passages"):
            raise ValueError(f"{path or 'smoke.jsonl'}: line {i + 1} needs 'question' and 'passages'")
        out.append((rec["question"], rec["passages"]))
        if len(out) >= limit:
            break
    return out


def add_profile_parser(subparsers) -> argparse.ArgumentParser:
    from kvfuse.cli import _add_model_args

    p = subparsers.add_parser("profile-layers", help="find the model's critical layers (for qcfuse) and store them",
                              description=__doc__.split("\n\n", 1)[1])
    p.add_argument("--data", default=None, help="calibration JSONL with question/passages records "
                                                "(default: the bundled smoke examples)")
    p.add_argument("--limit", type=int, default=3, help="calibration examples (default 3)")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio of the selectors (default 0.15)")
    p.add_argument("--top", type=int, default=3, help="critical layers kept (default 3)")
    p.add_argument("--max-new-tokens", type=int, default=8, help="full-answer tokens the KL runs over (default 8)")
    p.add_argument("--dry-run", action="store_true", help="print the profile, do not store it")
    _add_model_args(p)
    p.set_defaults(func=run_profile)
    return p


def run_profile(args) -> int:
    from kvfuse.cli import _engine
    from kvfuse.engine.profile import profile_layers, save_profile

    if not 0.0 < args.ratio <= 1.0:
        raise ValueError("--ratio must be in (0, 1]")
    if args.limit < 1 or args.top < 1 or args.max_new_tokens < 1:
        raise ValueError("--limit, --top and --max-new-tokens must be >= 1")
    examples = load_examples(args.data, args.limit)
    engine = _engine(args)
    prof = profile_layers(engine, examples, ratio=args.ratio, top=args.top, max_new_tokens=args.max_new_tokens,
                          progress=lambda s: print(s, flush=True))
    kl = prof["kl_per_layer"]
    print(f"\n{prof['model']}: KL(full || fused) per selector layer at ratio {args.ratio:g} "
          f"(reuse: {prof['kl_reuse']:.4f})")
    for i, x in enumerate(kl):
        mark = "  <- critical" if i in prof["critical_layers"] else ""
        print(f"  layer {i:3d}  {x:.4f}{mark}")
    print(f"critical layers: {prof['critical_layers']}")
    if not args.dry_run:
        print(f"stored in {save_profile(engine, prof)}")
    return 0

"""`kvfuse eval`: run strategies over an evaluation set against full prefill, then report.

    kvfuse eval --data ../shared/data --datasets 2wikimqa,hotpotqa --limit 20 \\
        --strategies reuse,cacheblend,epic --ratios 0.15,0.3 --out runs/qwen-dev
    kvfuse eval --smoke          # tiny end-to-end check with SmolLM2 on the bundled examples

The main CLI registers the subcommand with `add_eval_parser(subparsers)` and calls `run_eval(args)`.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path
from typing import Any

__all__ = ["add_eval_parser", "run_eval", "main"]

DEFAULTS: dict[str, Any] = {
    "model": "qwen2.5-coder-0.5b",
    "strategies": "full,reuse,cacheblend,epic,infoflow,prophetkv,qcfuse",
    "ratios": "0.15",
    "max_new_tokens": 32,
    "prompt": "qa",
    "seed": 0,
    "out": "eval_out",
}
SMOKE: dict[str, Any] = {
    "model": "smollm2-135m",
    "datasets": "2wikimqa",
    "limit": 2,
    "strategies": "full,reuse,cacheblend,epic",
    "ratios": "0.15",
    "max_new_tokens": 8,
}


def add_eval_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Registers `eval` on an argparse subparsers object; returns its parser (defaults `func=run_eval`)."""
    p = subparsers.add_parser(
        "eval", help="benchmark fusion strategies against full prefill (F1, fidelity, KL, TTFT)",
        description="Run each strategy x ratio over an evaluation set, always with full prefill as the "
                    "reference, and write per-example records, a summary table and a Pareto plot. "
                    "Reruns with the same --out skip what is already done.")
    p.add_argument("--data", metavar="PATH",
                   help="a JSONL file or a folder of them (the evaluation data, e.g. ../shared/data)")
    p.add_argument("--datasets", metavar="A,B", help="only these values of the 'dataset' field (default: all)")
    p.add_argument("--limit", type=int, metavar="N", help="examples per dataset, after a seeded shuffle")
    p.add_argument("--skip", type=int, metavar="N",
                   help="leave out the first N of each dataset's seeded order first (--skip 20 --limit 20: the "
                        "second twenty, e.g. a slice not used to pick a setting; default 0)")
    p.add_argument("--strategies", metavar="S,T",
                   help=f"strategies to compare; full always runs as the reference; a variant is "
                        f"name:key=value[:key=value] (its constructor's options, e.g. infoflow:rows=all:depth=0.333; "
                        f"a..b is an int range, a/b a tuple) (default: {DEFAULTS['strategies']})")
    p.add_argument("--ratios", metavar="R,S",
                   help=f"recompute ratios in (0, 1]; full and reuse ignore them (default: {DEFAULTS['ratios']})")
    p.add_argument("--model", metavar="NAME_OR_PATH",
                   help=f"model name, HF folder or .gguf (default: {DEFAULTS['model']})")
    p.add_argument("--seed", type=int, help="seed of the example shuffle, generation and bootstrap (default: 0)")
    p.add_argument("--max-new-tokens", type=int, dest="max_new_tokens", metavar="N",
                   help=f"tokens generated per answer (default: {DEFAULTS['max_new_tokens']})")
    p.add_argument("--prompt", choices=("qa", "chat"),
                   help="prompt preset: qa asks for the bare answer as LongBench does, chat answers in sentences "
                        f"(default: {DEFAULTS['prompt']})")
    p.add_argument("--out", metavar="DIR",
                   help=f"results folder: records.jsonl, summary.csv, summary.md, pareto.png "
                        f"(default: {DEFAULTS['out']}; --smoke: a temporary folder, removed when the smoke passes)")
    p.add_argument("--pareto-x", choices=("fraction", "ttft"), default="fraction", dest="pareto_x",
                   help="x axis of pareto.png: mean recompute fraction or mean TTFT (default: fraction)")
    p.add_argument("--pareto-y", choices=("score", "fidelity", "kl"), default="score", dest="pareto_y",
                   help="y axis of pareto.png: gold score relative to full, fidelity to full's answer, or KL to "
                        "full (default: score)")
    p.add_argument("--report-only", action="store_true", dest="report_only",
                   help="run nothing: rewrite the report from the records already in --out for the selected "
                        "examples and configs (those not on record are left out and counted)")
    p.add_argument("--smoke", action="store_true",
                   help="tiny end-to-end check (SmolLM2, 2 bundled examples, full,reuse,cacheblend,epic at 0.15, "
                        "8 new tokens); exits non-zero when any check fails")
    p.add_argument("--adapter", default=None,
                   help="fusion adapter: 'auto' (default: the one shipped for the model, if any, as the engine "
                        "serves it), 'none', 'packaged' (shipped for the model), or a .safetensors file; "
                        "runs with one are recorded as '<strategy>+adapter' beside those without, and the report "
                        "shows both when both are on record")
    p.add_argument("--links", default=None,
                   help="link rows (engine/links.py): 'auto' (default: those shipped for the model, if any, as the "
                        "engine serves them), 'none', 'packaged', or a .safetensors file; runs with them are recorded "
                        "as '<strategy>+links' (after any adapter tag)")
    p.add_argument("--guard", metavar="M,N",
                   help="also run every strategy with these guard margins (nats; GenerationOptions.guard_margin: a "
                        "near-tie on the fused path hands the answer to full prefill there), recorded as "
                        "'<strategy>+guard<M>' (default: none)")
    p.add_argument("--guard-tokens", type=int, dest="guard_tokens", metavar="N",
                   help="the --guard runs check only the answer's first N tokens (GenerationOptions.guard_tokens; "
                        "recorded as '+guard<M>/<N>'; default: every token)")
    p.add_argument("--guard-at", choices=("answer", "probe"), default="answer", dest="guard_at",
                   help="where the --guard runs read their gap (GenerationOptions.guard_at): 'answer' (the fused "
                        "answer's tokens; default) or 'probe' (before the fused prefill, the question probe's first "
                        "token; only strategies that probe; recorded as '<strategy>+probeguard<M>'; not with "
                        "--guard-tokens)")
    p.add_argument("--device", help="engine device (default: the engine's choice)")
    p.add_argument("--dtype", help="engine dtype, e.g. bfloat16 or float32 (default: the engine's choice)")
    p.add_argument("--no-progress", action="store_true", dest="no_progress", help="no progress bar")
    p.set_defaults(func=run_eval)
    return p


def _split(value: str | None, what: str) -> list[str]:
    items = [v.strip() for v in (value or "").split(",")]
    items = [v for v in items if v]
    if value is not None and not items:
        raise ValueError(f"{what}: empty list")
    return items


def _parse_numbers(value: str | None, flag: str, ok, what: str) -> list[float]:
    """A comma-separated list of numbers, each `ok(x)` (else a ValueError saying it is not `what`)."""
    out = []
    for item in _split(value, flag):
        try:
            x = float(item)
        except ValueError:
            raise ValueError(f"{flag}: {item!r} is not a number") from None
        if not (math.isfinite(x) and ok(x)):
            raise ValueError(f"{flag}: {item} is not {what}")
        out.append(x)
    return out


def _guard_tokens(value: int | None) -> int | None:
    if value is not None and value < 1:
        raise ValueError(f"--guard-tokens must be >= 1, got {value}")
    return value


def _guard_at(value: str | None, tokens: int | None) -> str:
    value = value or "answer"
    if value not in ("answer", "probe"):
        raise ValueError(f"--guard-at must be 'answer' or 'probe', got {value!r}")
    if value == "probe" and tokens is not None:
        raise ValueError("--guard-at probe reads no answer token: give no --guard-tokens")
    return value


def _parse_guards(value: str | None) -> list[float]:
    return _parse_numbers(value, "--guard", lambda g: g > 0, "a margin > 0 (nats)")


def _parse_ratios(value: str) -> list[float]:
    return _parse_numbers(value, "--ratios", lambda r: 0.0 < r <= 1.0, "in (0, 1]")


def _resolve(args: argparse.Namespace) -> dict[str, Any]:
    """Fills defaults (the smoke ones under --smoke) for options not given; validates."""
    smoke = bool(getattr(args, "smoke", False))
    base = {**DEFAULTS, **(SMOKE if smoke else {})}

    def get(name: str) -> Any:
        v = getattr(args, name, None)
        return base.get(name) if v is None else v

    data = getattr(args, "data", None)
    if data is None:
        if not smoke:
            raise ValueError("--data is required: a JSONL file or a folder of them (e.g. ../shared/data)")
        from .data import smoke_data_path
        data = smoke_data_path()
    limit = get("limit")
    if limit is not None and limit < 0:
        raise ValueError(f"--limit must be >= 0, got {limit}")
    skip = getattr(args, "skip", None) or 0  # checked where the examples are selected, before any model work
    mnt = int(get("max_new_tokens"))
    if mnt < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {mnt}")
    if smoke and getattr(args, "report_only", False):
        raise ValueError("--report-only and --smoke do not combine")
    out = getattr(args, "out", None)
    temporary = out is None and smoke  # created by run_eval once the inputs are validated
    if out is None and not smoke:
        out = DEFAULTS["out"]
    if out is not None:
        from kvfuse.engine.validate import check_dir_path

        check_dir_path(out, "--out")  # before any example is read or model loaded
    return {
        "temporary_out": temporary,
        "smoke": smoke,
        "data": Path(data),
        "datasets": _split(get("datasets"), "--datasets") or None,
        "limit": limit,
        "skip": skip,
        "strategies": _split(get("strategies"), "--strategies"),
        "ratios": _parse_ratios(get("ratios")),
        "guards": _parse_guards(getattr(args, "guard", None)),
        "guard_tokens": _guard_tokens(getattr(args, "guard_tokens", None)),
        "guard_at": _guard_at(getattr(args, "guard_at", None), getattr(args, "guard_tokens", None)),
        "model": str(get("model")),
        "seed": int(get("seed")),
        "max_new_tokens": mnt,
        "prompt": str(get("prompt")),
        "out": None if out is None else Path(out),
        "adapter": getattr(args, "adapter", None) or "auto",
        "links": getattr(args, "links", None) or "auto",
        "device": getattr(args, "device", None),
        "dtype": getattr(args, "dtype", None),
        "pareto_x": getattr(args, "pareto_x", None) or "fraction",
        "pareto_y": getattr(args, "pareto_y", None) or "score",
        "progress": not getattr(args, "no_progress", False),
        "report_only": bool(getattr(args, "report_only", False)),
    }


ADAPTER_TAG = "+adapter"  # runs with an offline fusion adapter (documents computed with it)
ONLINE_TAG = "+online"    # runs with an online one (the fused prefill's computed rows run it)
LINKS_TAG = "+links"      # runs whose fused prompts carry link rows


def _links_for(value: str, model: str) -> Any:
    """--links resolved and read before any model work (a clear error for a missing or malformed file): the
    LinkRows the engine will run, or None."""
    from kvfuse.engine.links import load_links, resolve_links
    from kvfuse.engine.weights import registry_name

    try:
        path = resolve_links(value, registry_name(model) or model)
    except ValueError as exc:
        raise ValueError(f"--links {value}: {exc}") from None
    return None if path is None else load_links(path)


def _adapter_for(value: str, model: str) -> Any:
    """--adapter resolved and read before any model work (a clear error for a missing or malformed file): the
    FusionAdapter the engine will run, or None. Read once; the engine is handed the adapter itself."""
    from kvfuse.engine.adapter import load_adapter, resolve_adapter
    from kvfuse.engine.weights import registry_name

    try:  # by the name the model loads as (a registry model's GGUF gets that model's adapter, as it would served)
        path = resolve_adapter(value, registry_name(model) or model)
    except ValueError as exc:
        raise ValueError(f"--adapter {value}: {exc}") from None
    return None if path is None else load_adapter(path)


def _adapter_tag(adapter: Any) -> str:
    """The label suffix of runs with `adapter` (none: "")."""
    if adapter is None:
        return ""
    return ONLINE_TAG if adapter.stage == "online" else ADAPTER_TAG


def run_eval(args: argparse.Namespace, engine_factory: Any = None) -> int:
    """Runs the evaluation described by `args`; returns the exit code (0 ok, 1 a smoke check failed).

    Args:
        args: the parsed `eval` options.
        engine_factory: optional zero-argument callable returning an engine (tests); default loads
            `FusionEngine.from_pretrained(model, device=..., dtype=...)`.

    Raises:
        ValueError: bad options or data, with a one-line message.
    """
    from .data import load_examples
    from .report import write_report
    from .runner import (EvalRunner, _offline_strategies, attach_corpus, attach_pool, build_configs, load_engine,
                         record_key)

    opt = _resolve(args)
    examples = load_examples(opt["data"], datasets=opt["datasets"], limit=opt["limit"], seed=opt["seed"],
                             skip=opt["skip"])
    if not examples:
        raise ValueError("no examples selected (check --datasets / --limit)")
    configs = build_configs(opt["strategies"], opt["ratios"], opt["guards"], opt["guard_tokens"], opt["guard_at"])
    adapter = _adapter_for(opt["adapter"], opt["model"])
    links = _links_for(opt["links"], opt["model"])
    if engine_factory is None:
        def engine_factory() -> Any:
            engine = load_engine(opt["model"], device=opt["device"], dtype=opt["dtype"], prompt=opt["prompt"],
                                 adapter=adapter, links=links)
            from kvfuse.engine.corpus import CORPUS_PICKS

            picks = {_variant_pick(name) for name in _offline_strategies(configs)} - {None}
            if picks & set(CORPUS_PICKS):
                attach_corpus(engine, examples)  # fusionrag: neighbours from the selected examples' passages
            if "pool" in picks:  # the pool: passages of examples outside the selection (see attach_pool); with
                # every example selected none are, and the pool fills from the evaluated requests themselves
                attach_pool(engine, load_examples(opt["data"], datasets=opt["datasets"], seed=opt["seed"],
                                                  skip=opt["skip"] + (opt["limit"] or 0)), exclude=examples)
            return engine

    out: Path = opt["out"] or Path(tempfile.mkdtemp(prefix="kvfuse-eval-smoke-"))
    out.mkdir(parents=True, exist_ok=True)
    extra = {"device": opt["device"], "dtype": opt["dtype"]}
    n_ds = len({e.dataset for e in examples})
    print(f"eval: {len(examples)} examples from {n_ds} dataset(s), configs: "
          f"{', '.join(c.label for c in configs)}; model {opt['model']}; prompt {opt['prompt']}; out {out}",
          file=sys.stderr)

    def make_runner() -> EvalRunner:
        return EvalRunner(engine_factory, out, model=opt["model"], max_new_tokens=opt["max_new_tokens"],
                          seed=opt["seed"], progress=opt["progress"], extra=extra, prompt=opt["prompt"],
                          adapter_tag=_adapter_tag(adapter), links_tag=LINKS_TAG if links is not None else "",
                          adapter_digest=adapter.digest[:16] if adapter is not None else "",
                          links_digest=links.digest[:16] if links is not None else "")

    runner = make_runner()
    runner.check_variants(configs)
    if runner.store.bad_lines:
        print(f"warning: skipped {runner.store.bad_lines} unreadable line(s) of {runner.store.path}", file=sys.stderr)
    if not opt["report_only"]:
        stats = runner.run(examples, configs)
        (out / "run_stats.json").write_text(json.dumps(stats.as_dict(), indent=2), encoding="utf-8")
        print(stats.describe(), file=sys.stderr)

    # example x config order: the report lists strategies in the order they were asked for (full first)
    # both the runs with the fusion adapter and those without, when on record (the report shows them side by side)
    def label(c, tag: str = "") -> str:
        return c.strategy + tag + c.guard_tag

    labels = [(c, label(c)) for c in configs] + [(c, label(c, tag)) for c in configs
                                                 for tag in (ADAPTER_TAG, ONLINE_TAG, LINKS_TAG,
                                                             ADAPTER_TAG + LINKS_TAG, ONLINE_TAG + LINKS_TAG)
                                                 if c.strategy != "full"]
    keys = [record_key(e.id, label, c.ratio, opt["model"], opt["max_new_tokens"], opt["prompt"], opt["dtype"])
            for e in examples
            for c, label in labels]
    records = [runner.store.get(k) for k in keys if runner.store.get(k) is not None]
    if opt["report_only"]:
        if not records:
            raise ValueError(f"--report-only: none of the selected runs is on record in {out / 'records.jsonl'}")
        tagged = sum(ADAPTER_TAG in r["strategy"] or ONLINE_TAG in r["strategy"] for r in records)
        print(f"report only: {len(records) - tagged} of {len(examples) * len(configs)} selected runs on record"
              + (f", and {tagged} with the fusion adapter" if tagged else ""), file=sys.stderr)
    rows, md = write_report(records, out, seed=opt["seed"], pareto_x=opt["pareto_x"],
                             pareto_y=opt["pareto_y"])
    print(md)
    print(f"wrote {out / 'records.jsonl'}, summary.csv, summary.md, pareto.png", file=sys.stderr)

    if not opt["smoke"]:
        return 0
    failures = smoke_checks(out, examples, configs, records, rows, stats)
    again = make_runner()
    again.progress = False
    stats2 = again.run(examples, configs)
    if stats2.executed != 0 or stats2.skipped != stats2.total:
        failures.append(f"resume: second call computed {stats2.executed} run(s), skipped {stats2.skipped} "
                        f"of {stats2.total}")
    if again.engine is not None:
        failures.append("resume: second call loaded the engine although everything was done")
    if failures:
        print("SMOKE FAILED:\n  " + "\n  ".join(failures), file=sys.stderr)
        return 1
    print(f"SMOKE OK: {len(records)} records, {len(rows)} table rows, all metrics finite, fidelity(full) = 1, "
          f"KL(full) ~ 0, resume skipped {stats2.skipped}/{stats2.total}", file=sys.stderr)
    if opt["temporary_out"]:
        import shutil

        shutil.rmtree(out, ignore_errors=True)
        print(f"(removed the temporary {out}; pass --out DIR to keep the results)", file=sys.stderr)
    return 0


def _variant_pick(name: str) -> str | None:
    """Where a strategy's cache variant takes its context from (its `pick`), or None without a variant."""
    from kvfuse.engine.fusion import make_strategy

    strat = make_strategy(name)
    if not getattr(strat, "cache_variant", None):
        return None
    return strat.variant_options.get("pick", "similar")


def smoke_checks(out: Path, examples: list, configs: list, records: list[dict], rows: list, stats: Any) -> list[str]:
    """The end-to-end assertions of `--smoke`; returns the failures (empty when all pass)."""
    fail: list[str] = []
    expected = len(examples) * len(configs)
    if len(records) != expected:
        fail.append(f"records: {len(records)} of {expected} expected")
    for name in ("records.jsonl", "summary.csv", "summary.md", "pareto.png"):
        f = out / name
        if not f.exists() or f.stat().st_size == 0:
            fail.append(f"{name} missing or empty")
    if not rows:
        fail.append("summary table is empty")

    def finite(x: Any) -> bool:
        try:
            return math.isfinite(float(x))
        except (TypeError, ValueError):
            return False

    for r in records:
        tag = f"{r['strategy']}@{r['ratio']:g} on {r['example_id']}"
        for k in ("score", "fidelity", "kl", "ttft_s", "recompute_fraction"):
            if not finite(r.get(k)):
                fail.append(f"{tag}: {k} = {r.get(k)!r} is not finite")
        if not 0.0 <= float(r.get("recompute_fraction") or 0.0) <= 1.0 + 1e-9:
            fail.append(f"{tag}: recompute fraction {r.get('recompute_fraction')} outside [0, 1]")
        if r["strategy"] == "full":
            if not r.get("token_ids"):
                fail.append(f"{tag}: the full answer is empty (nothing to teacher-force)")
            if r.get("fidelity") != 1.0:
                fail.append(f"{tag}: fidelity(full) = {r.get('fidelity')} != 1.0")
            if finite(r.get("kl")) and abs(float(r["kl"])) > 1e-4:
                fail.append(f"{tag}: KL(full || full) = {r['kl']} is not ~0")
        if r["strategy"] == "reuse" and finite(r.get("recompute_fraction")) and r["recompute_fraction"] > 1e-9:
            fail.append(f"{tag}: reuse recomputed {r['recompute_fraction']:.3f} of the document tokens")
        if finite(r.get("kl")) and float(r["kl"]) < -1e-9:
            fail.append(f"{tag}: negative KL {r['kl']}")
    # the self-check is stored on the full records, so it survives a resumed --out
    checked = [r for r in records if r["strategy"] == "full" and r.get("kl_selfcheck")]
    if not checked:
        fail.append("no KL(full || full) self-check was computed")
    for r in checked:
        if not finite(r.get("kl")) or abs(float(r["kl"])) > 1e-4:
            fail.append(f"self-check on {r['example_id']}: KL(full || full) = {r.get('kl')}")
    for row in rows:
        for k in ("score", "score_lo", "score_hi", "fidelity", "fidelity_lo", "fidelity_hi", "kl", "ttft_s",
                  "recompute_fraction"):
            if not finite(getattr(row, k)):
                fail.append(f"table {row.dataset}/{row.strategy}@{row.ratio:g}: {k} is not finite")
    if stats.passage_slots and stats.precompute_hits + stats.precompute_misses == 0:
        fail.append("precompute reported neither hits nor misses")
    return fail


def main(argv: list[str] | None = None) -> int:
    """Stand-alone entry (`python -m kvfuse.evaluation ...`), the same options as `kvfuse eval`."""
    parser = argparse.ArgumentParser(prog="kvfuse")
    sub = parser.add_subparsers(dest="command", required=True)
    add_eval_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "eval":
        argv = ["eval", *argv]
    args = parser.parse_args(argv)
    try:
        return run_eval(args)
    except ValueError as e:
        print(f"kvfuse eval: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

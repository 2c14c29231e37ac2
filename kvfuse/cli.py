"""The `kvfuse` command line: demo, precompute, ask, eval.

Bad input ends with one clear line on stderr and exit status 2, never a traceback.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from importlib import resources
from pathlib import Path

__all__ = ["main"]


class CliError(Exception):
    """A user-facing error: printed as one line."""


def _engine(args):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from kvfuse.engine.api import FusionEngine

    threads = getattr(args, "threads", None)
    if threads:
        import torch

        torch.set_num_threads(threads)
    return FusionEngine.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                        cache_dir=args.cache_dir, disk_cache=not getattr(args, "no_disk_cache", False))


def _add_model_args(p: argparse.ArgumentParser) -> None:
    from kvfuse.engine.api import DEFAULT_MODEL

    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"registry name (qwen2.5-coder-0.5b, smollm2-135m, qwen2.5-coder-1.5b), a .gguf file or a "
                        f"Hugging Face model folder (default: {DEFAULT_MODEL})")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", default=None, choices=["bf16", "fp16", "fp32"], help="default bf16")
    p.add_argument("--cache-dir", default=None, help="converted weights and document caches "
                                                     "(default: $KVFUSE_CACHE_DIR or ~/.cache/kvfuse)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")


def _add_gen_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", default=None,
                   help="fusion strategy (default: the engine's, kvfuse.engine.fusion.DEFAULT_STRATEGY: infoflow)")
    p.add_argument("--ratio", type=float, default=0.15, help="recompute ratio in [0, 1] (default 0.15)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--temperature", type=float, default=0.0)


def _strategy(args: argparse.Namespace) -> str:
    from kvfuse.engine.fusion import DEFAULT_STRATEGY

    return args.strategy or DEFAULT_STRATEGY


def _load_docs(path: str) -> list[dict]:
    """Documents from JSON or JSONL: objects with id/text (title optional), or eval records with passages."""
    p = Path(path)
    if not p.is_file():
        raise CliError(f"no such file: {path}")
    text = p.read_text(encoding="utf-8")
    try:
        if p.suffix == ".jsonl":
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            data = json.loads(text)
            rows = data.get("documents", []) if isinstance(data, dict) else data
    except json.JSONDecodeError as e:
        raise CliError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    docs: dict[str, dict] = {}
    for i, r in enumerate(rows):
        if not isinstance(r, dict):
            raise CliError(f"{path}: record {i + 1} is not an object")
        for d in r.get("passages", [r]):
            if "text" not in d:
                raise CliError(f"{path}: record {i + 1} has no 'text' (expected id/text or passages)")
            did = str(d.get("id") or f"{p.stem}-{len(docs)}")
            docs[did] = {"id": did, "text": d["text"], "title": d.get("title", "")}
    if not docs:
        raise CliError(f"{path}: no documents found")
    return list(docs.values())


def cmd_demo(args) -> int:
    from kvfuse.engine.types import as_documents

    data = json.loads(resources.files("kvfuse").joinpath("data/demo.json").read_text(encoding="utf-8"))
    args.no_disk_cache = True
    print(f"loading {args.model} ...", flush=True)
    engine = _engine(args)
    docs = {d.id: d for d in as_documents(data["documents"])}
    rep = engine.precompute(list(docs.values()))
    print(f"model {engine.model_name} on {engine.device} ({str(engine.dtype).replace('torch.', '')}); "
          f"precomputed {rep.misses} documents ({rep.tokens} tokens) in {rep.seconds:.2f} s\n")
    for q in data["questions"]:
        qdocs = [docs[i] for i in q["docs"]]
        print(f"Q: {q['question']}   [{len(qdocs)} documents]")
        for strat in ("full", _strategy(args)):
            r = engine.generate(q["question"], qdocs, strategy=strat, recompute_ratio=args.ratio,
                                max_new_tokens=args.max_new_tokens, temperature=args.temperature)
            label = strat if strat == "full" else f"{strat}@{args.ratio:.0%}"
            print(f"  {label:<16} ttft {r.ttft_s * 1000:7.0f} ms   recomputed {r.recomputed_tokens:4d}/"
                  f"{r.doc_tokens} doc tokens   hits {r.cache_hits}/{len(qdocs)}   -> {r.text.strip()!r}")
        print()
    return 0


def cmd_precompute(args) -> int:
    docs = _load_docs(args.file)
    engine = _engine(args)
    rep = engine.precompute(docs)
    print(f"{len(docs)} documents: {rep.misses} computed ({rep.tokens} tokens), {rep.hits} already cached; "
          f"{rep.seconds:.2f} s; cache at {engine.config.disk_cache_dir}")
    return 0


def cmd_ask(args) -> int:
    docs = _load_docs(args.docs) if args.docs else []
    if args.doc_ids:
        wanted = [x for x in args.doc_ids.split(",") if x]
        by_id = {d["id"]: d for d in docs}
        missing = [x for x in wanted if x not in by_id]
        if missing:
            raise CliError(f"unknown document ids: {', '.join(missing)}")
        docs = [by_id[x] for x in wanted]
    engine = _engine(args)
    stream = engine.stream(args.question, docs, strategy=_strategy(args), recompute_ratio=args.ratio,
                           max_new_tokens=args.max_new_tokens, temperature=args.temperature)
    if args.json:
        for _ in stream:
            pass
        print(json.dumps(stream.result.as_dict(), indent=2))
        return 0
    for delta in stream:
        print(delta, end="", flush=True)
    r = stream.result
    print(f"\n\n[{r.strategy} ttft {r.ttft_s * 1000:.0f} ms, recomputed {r.recomputed_tokens}/{r.doc_tokens} doc "
          f"tokens, cache hits {r.cache_hits} misses {r.cache_misses}]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvfuse", description="Fast RAG answers from fused per-document KV caches.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="answer a few questions over a bundled document set, full vs fused")
    _add_model_args(p)
    _add_gen_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("precompute", help="compute and store document caches from a JSON/JSONL file")
    p.add_argument("file", help="JSONL of {id, text[, title]} (or records with 'passages'), or JSON list")
    _add_model_args(p)
    p.set_defaults(func=cmd_precompute)

    p = sub.add_parser("ask", help="answer one question over documents")
    p.add_argument("question")
    p.add_argument("--docs", help="JSON/JSONL file of documents")
    p.add_argument("--doc-ids", help="comma-separated ids to use from --docs, in this order")
    p.add_argument("--json", action="store_true", help="print the full result as JSON")
    _add_model_args(p)
    _add_gen_args(p)
    p.set_defaults(func=cmd_ask)

    try:
        from kvfuse.evaluation.cli import add_eval_parser, run_eval
    except ImportError:
        pass
    else:
        add_eval_parser(sub)
        sub.choices["eval"].set_defaults(func=run_eval)

    from kvfuse.profile_cli import add_profile_parser

    add_profile_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ValueError, FileNotFoundError, KeyError, RuntimeError) as e:
        msg = e.args[0] if isinstance(e, KeyError) and e.args else e
        print(f"kvfuse: error: {msg}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kvfuse: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())

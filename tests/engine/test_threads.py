"""The scheduler thread's own CPU thread count: set for that thread alone, never for the caller or later threads."""
from __future__ import annotations

import threading

import pytest
import torch

from kvfuse.engine.config import EngineConfig
from kvfuse.engine.threads import default_threads, process_threads, set_own_threads

from cases import DOCS, QUESTION


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@pytest.fixture
def two_threads():
    """A process default of 2 intra-op threads (so that 1 differs from it on any machine), restored after."""
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(prev)


def test_set_own_threads_changes_the_calling_thread_alone(two_threads):
    def worker():
        before = set_own_threads(1)
        seen = {"before": before, "own": torch.get_num_threads()}
        torch.exp(torch.randn(100_000))  # a parallel op does not re-read the default
        seen["after_op"] = torch.get_num_threads()
        seen["new_thread"] = _in_thread(torch.get_num_threads)  # started after the change
        return seen

    seen = _in_thread(worker)
    assert seen == {"before": 2, "own": 1, "after_op": 1, "new_thread": 2}
    assert torch.get_num_threads() == 2  # the caller's
    assert default_threads() == 2


def test_plain_set_num_threads_would_leak_into_later_threads(two_threads):
    """Why set_own_threads exists: torch.set_num_threads in one thread changes what threads started later take."""
    def worker():
        torch.get_num_threads()
        torch.set_num_threads(1)
        return _in_thread(torch.get_num_threads)

    assert _in_thread(worker) == 1
    torch.set_num_threads(2)


def test_process_threads_widens_a_narrowed_thread_and_restores(two_threads):
    def narrowed():
        set_own_threads(1)
        with process_threads():
            inside = torch.get_num_threads()
        return inside, torch.get_num_threads(), default_threads()

    def untouched():  # a thread that never narrowed itself: nothing changes, its own count stays
        torch.get_num_threads()
        torch.set_num_threads(1)
        with process_threads():
            return torch.get_num_threads()

    assert _in_thread(narrowed) == (2, 1, 2)
    assert _in_thread(untouched) == 1
    torch.set_num_threads(2)
    with pytest.raises(ValueError, match=">= 1"):
        set_own_threads(0)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "1"])
def test_config_rejects_bad_thread_counts(bad):
    with pytest.raises(ValueError, match="scheduler_cpu_threads"):
        EngineConfig(scheduler_cpu_threads=bad)


@pytest.mark.parametrize("configured, expected", [(None, 2), (1, 1)])
def test_scheduler_thread_runs_requests_with_its_count(tiny_engine, two_threads, configured, expected):
    """On the CPU the scheduler keeps the process default (its thread runs the model); configured, it takes the
    count for itself, and the caller's count is untouched either way."""
    engine = tiny_engine("llama", scheduler_cpu_threads=configured)
    seen = []
    prepare = engine._prepare

    def spy(*a, **k):
        seen.append((threading.current_thread().name, torch.get_num_threads()))
        return prepare(*a, **k)

    engine._prepare = spy
    r = engine.generate(QUESTION, DOCS, strategy="infoflow", recompute_ratio=0.3, max_new_tokens=3)
    assert r.token_ids
    assert seen == [("kvfuse-scheduler", expected)]
    assert torch.get_num_threads() == 2


def test_the_corpus_embedder_uses_every_core_from_a_one_thread_scheduler(two_threads, monkeypatch):
    """coinrag embeds nuggets on the scheduler thread: on a GPU engine (one intra-op thread there) the embedder
    still gets the process default, and the thread's own count is back after."""
    from kvfuse.engine import corpus

    seen = []

    class FakeMiniLM:
        def encode(self, texts, **kw):
            seen.append(torch.get_num_threads())
            return torch.ones(len(texts), 384)

    monkeypatch.setattr(corpus, "_MINILM", FakeMiniLM())
    embed = corpus.minilm_embedder()

    def worker():
        set_own_threads(1)
        out = embed(["a", "b"])
        return tuple(out.shape), torch.get_num_threads()

    assert _in_thread(worker) == ((2, 384), 1)
    assert seen == [2]

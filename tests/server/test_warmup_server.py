"""`kvfuse serve --warmup LO:HI`: the options are checked before the model loads, the warm-up runs before the
server listens and is reported in /health; on CUDA (skipped elsewhere) the first request of a never-seen layout
then replays a prefill graph, as the server's /metrics counts."""
from __future__ import annotations

import subprocess
import sys

import httpx
import pytest
import torch
from serving import KEY

HEADERS = {"Authorization": f"Bearer {KEY}"}


@pytest.mark.parametrize("args, words", [
    (["--warmup", "800:400"], "--warmup"),
    (["--warmup", "a lot"], "LO:HI"),
    (["--warmup", "10:400"], "--warmup"),
    (["--warmup", "200:400", "--warmup-strategies", "nope"], "unknown strategy"),
    (["--warmup", "200:400", "--warmup-ratios", "2"], "--warmup-ratios"),
    (["--warmup", "200:400", "--warmup-questions", "40:8"], "--warmup-questions"),
    (["--warmup-ratios", "0.2"], "need --warmup"),
])
def test_bad_warmup_options_stop_the_server_before_loading(args, words):
    p = subprocess.run([sys.executable, "-m", "kvfuse.cli", "serve", "--model", "smollm2-135m", *args],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and words in p.stderr and "loading" not in p.stderr, p.stderr


def test_warmup_runs_before_serving_and_is_reported(start_server):
    srv = start_server("--warmup", "200:400", "--warmup-strategies", "infoflow,full", "--warmup-questions", "8:40")
    health = httpx.get(f"{srv.url}/health").json()
    assert health["status"] == "ok"
    # the CPU has no CUDA graphs: nothing to capture, and the server says so
    assert health["warmup"]["requests"] == 0 and health["warmup"]["captured"] == 0
    assert "nothing to capture" in srv.logs()
    r = httpx.post(f"{srv.url}/v1/completions", headers=HEADERS, timeout=60,
                   json={"model": srv.model, "prompt": "Who founded it?", "max_tokens": 2,
                         "documents": [{"id": "w1", "text": "The Quillon festival was founded by Tomas Reyes."}]})
    assert r.status_code == 200, r.text


def _counter(metrics: str, name: str) -> float:
    for line in metrics.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "_total "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} not in /metrics")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_on_cuda_a_warmed_server_replays_the_first_request_of_a_new_layout(start_server):
    srv = start_server("--device", "cuda", "--dtype", "bf16", "--warmup", "64:1500", "--warmup-strategies",
                       "infoflow", "--warmup-questions", "8:64", "--warmup-ratios", "0.2")
    health = httpx.get(f"{srv.url}/health").json()
    assert health["warmup"]["captured"] >= 1, health
    g = torch.Generator().manual_seed(3)
    words = "harbour lantern river stone bridge festival music observatory director double star motion".split()
    layouts = []
    for i in range(3):  # never-seen documents of new lengths, registered first (their own passes are not counted)
        docs = [{"id": f"new-{i}-{j}", "text": " ".join(words[int(t)] for t in torch.randint(0, len(words), (n,),
                                                                                               generator=g))}
                for j, n in enumerate(torch.randint(20, 60, (3,), generator=g).tolist())]
        r = httpx.post(f"{srv.url}/v1/documents", json={"documents": docs}, headers=HEADERS, timeout=120)
        assert r.status_code == 200, r.text
        layouts.append([d["id"] for d in docs])
    before = httpx.get(f"{srv.url}/metrics").text
    for ids in layouts:
        r = httpx.post(f"{srv.url}/v1/completions", headers=HEADERS, timeout=120,
                       json={"model": srv.model, "prompt": "What was built?", "max_tokens": 2, "documents": ids,
                             "strategy": "infoflow", "recompute_ratio": 0.2})
        assert r.status_code == 200, r.text
        assert r.json()["kvfuse"]["cache_hits"] == 3
    after = httpx.get(f"{srv.url}/metrics").text
    name = "kvfuse_engine_prefill_graph_{}"
    assert _counter(after, name.format("replays")) - _counter(before, name.format("replays")) >= 3
    assert _counter(after, name.format("captures")) == _counter(before, name.format("captures"))
    assert _counter(after, "kvfuse_engine_prefill_eager_runs") == _counter(before, "kvfuse_engine_prefill_eager_runs")

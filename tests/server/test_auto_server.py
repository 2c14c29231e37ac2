"""strategy="auto" through the real server process: `kvfuse serve --front FILE` serves the front's choices, which
come back in the response's kvfuse extension and answer as naming the point would."""
from __future__ import annotations

import pytest
from serving import DOCS, KEY

openai = pytest.importorskip("openai", reason="the openai client is part of the dev extra")

QUESTION = "When was the Larkspur Observatory built?"


def test_auto_picks_from_the_served_front(start_server, local_engine, tmp_path):
    from kvfuse.engine.auto import Front, FrontPoint

    front = Front("tiny", "", (FrontPoint("cacheblend", 0.3, 0.6, None, {"cpu": 0.4}),
                               FrontPoint("epic", 0.3, 0.5, None, {"cpu": 0.3})), ("cacheblend", 0.3))
    srv = start_server("--front", str(front.save(tmp_path / "front.json")))
    client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key=KEY, max_retries=0)
    docs = [{"id": d["id"], "text": d["text"]} for d in DOCS]
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=8, temperature=0,
                                  extra_body={"documents": docs, "strategy": "auto", "target_fidelity": 0.45})
    ext = r.model_extra["kvfuse"]
    assert (ext["strategy"], ext["auto"]["strategy"], ext["auto"]["ratio"]) == ("epic", "epic", 0.3)
    want = local_engine.generate(QUESTION, docs, max_new_tokens=8, temperature=0.0, strategy="epic",
                                 recompute_ratio=0.3)
    assert r.choices[0].text == want.text
    r = client.completions.create(model=srv.model, prompt=QUESTION, max_tokens=4, temperature=0,
                                  extra_body={"documents": docs, "strategy": "auto", "ttft_budget_s": 3600})
    assert r.model_extra["kvfuse"]["auto"]["strategy"] == "full"  # everything fits: the most faithful


def test_a_bad_front_file_stops_the_server_before_loading(tmp_path):
    import subprocess
    import sys

    bad = tmp_path / "front.json"
    bad.write_text('{"format": "kvfuse-front/1", "points": []}')
    p = subprocess.run([sys.executable, "-m", "kvfuse.cli", "serve", "--model", "smollm2-135m", "--front", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "front" in p.stderr and "loading" not in p.stderr

"""Critical-layer profiling (`kvfuse profile-layers`) and qcfuse reading the stored profile."""
from __future__ import annotations

import json

import torch
from fixtures import tiny_model_dir

from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.profile import SingleLayerProbe, load_profile, profile_layers, profile_path, save_profile
from kvfuse.engine.types import as_documents

from test_strategies_engine import DOCS, QUESTION


def test_profile_ranks_layers_by_kl_and_qcfuse_uses_it(fusion_engine, tmp_path, monkeypatch):
    monkeypatch.setenv("KVFUSE_CACHE_DIR", str(tmp_path))
    e = fusion_engine("llama")
    assert load_profile(e) is None
    strat = make_strategy("qcfuse")
    e._prepare(QUESTION, as_documents(DOCS), strat)
    assert strat.probe_layers(3) == (0, 1, 2)  # the default: 1/4, 1/2, 3/4 of the depth

    prof = profile_layers(e, [(QUESTION, DOCS)], ratio=0.2, top=1, max_new_tokens=3)
    kl = prof["kl_per_layer"]
    assert len(kl) == 3 and prof["critical_layers"] == [min(range(3), key=lambda i: (kl[i], i))]
    # the KL of a layer is the selector's own: recompute one by hand
    ref = e.generate(QUESTION, DOCS, strategy="full", max_new_tokens=3)
    full = e.next_token_logprobs(QUESTION, DOCS, ref.token_ids, strategy="full")
    one = e.next_token_logprobs(QUESTION, DOCS, ref.token_ids, strategy=SingleLayerProbe(1), recompute_ratio=0.2)
    by_hand = float((full.exp() * (full - one)).sum(-1).clamp_min(0).mean())
    assert abs(by_hand - kl[1]) < 1e-5

    path = save_profile(e, prof)
    assert path == profile_path(e) and path.parent == tmp_path / "profiles" and e.namespace.model in path.name
    assert load_profile(e)["critical_layers"] == prof["critical_layers"]
    strat = make_strategy("qcfuse")
    e._prepare(QUESTION, as_documents(DOCS), strat)  # the engine hands the profile over
    assert strat.probe_layers(3) == tuple(prof["critical_layers"])
    r = e.generate(QUESTION, DOCS, strategy="qcfuse", recompute_ratio=0.2, max_new_tokens=2)
    assert r.recomputed_tokens == round(0.2 * r.doc_tokens)


def test_cli_profile_layers(tmp_path, capsys):
    from kvfuse.cli import main

    model = tiny_model_dir("qwen2")
    rc = main(["profile-layers", "--model", str(model), "--dtype", "fp32", "--device", "cpu", "--limit", "1",
               "--max-new-tokens", "2", "--top", "2", "--cache-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0, out
    files = list((tmp_path / "profiles").glob("*.json"))
    assert len(files) == 1
    prof = json.loads(files[0].read_text())
    assert len(prof["critical_layers"]) == 2 and prof["n_layers"] == 3 and prof["examples"] == 1
    assert "critical layers" in out
    assert main(["profile-layers", "--model", str(model), "--ratio", "0"]) == 2
    assert torch.isfinite(torch.tensor(prof["kl_per_layer"])).all()

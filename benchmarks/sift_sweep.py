"""sift's index thresholds against answer identity and attention density (embedded model, CPU).

    python benchmarks/sift_sweep.py      # 15 dev 2wikimqa examples in `kvfuse eval`'s order, greedy, 32 tokens
"""
import statistics as st
from kvfuse.engine.api import FusionEngine
from kvfuse.engine.fusion import make_strategy
from kvfuse.engine.prompt import PROMPT_PRESETS
from kvfuse.evaluation.data import read_jsonl, select_examples
eng = FusionEngine.from_pretrained(device="cpu", disk_cache=False, adapter=None, prompt=PROMPT_PRESETS["qa"])
exs = select_examples(read_jsonl("../shared/data"), datasets=["2wikimqa"], limit=15, seed=0)
fulls = [eng.generate(e.question, e.docs, strategy="full", max_new_tokens=32).token_ids for e in exs]
for lm, cm in [(0.95, 0.9), (0.8, 0.5), (0.6, 0.3)]:
    same, dens = 0, []
    for e, f in zip(exs, fulls):
        s = make_strategy("sift", local_mass=lm, cross_mass=cm, on_miss="compute", min_tokens=0, max_density=1.0)
        r = eng.generate(e.question, e.docs, strategy=s, max_new_tokens=32)
        same += r.token_ids == f
        dens.append(r.extra["sift"]["density"])
    print(f"local {lm} cross {cm}: identical answers {same}/{len(exs)}, density mean {st.mean(dens):.3f}", flush=True)

import json
import sys

from treeflash import LLM, SamplingParams
from treeflash.engine.llm import EMBEDDED

texts = [p["text"] for p in json.loads((EMBEDDED / "heldout_prompts.json").read_text())["prompts"]]
params = SamplingParams(max_tokens=48, ignore_eos=True)
out = {}
for spec, budget in (("off", None), ("ddtree", 15), ("dflash", None)):
    llm = LLM(spec=spec, tree_budget=budget, device="cpu", dtype="float32")
    res = llm.generate(texts, params)
    out[f"{spec}-{budget}"] = [o.token_ids for o in res]
    m = [o.metrics.get("speculative_decoding", {}).get("mean_acceptance_length") for o in res]
    print(spec, budget, "acceptance", m, flush=True)
json.dump(out, open(sys.argv[1], "w"))

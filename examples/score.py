"""Next-token logits at every position of a prompt, computed through the paged KV cache.

    python examples/score.py "import os"
"""

import sys

from treeflash import LLM

llm = LLM(device="cpu")
ids = llm.encode(sys.argv[1] if len(sys.argv) > 1 else "import os")
logits = llm.score(ids, chunk_size=4)  # [len(ids), vocab]
for pos, tok in enumerate(ids[1:]):
    lp = logits[pos].log_softmax(-1)[tok].item()
    print(f"{pos:4d} {llm.tokenizer.decode([tok])!r:>12} logprob {lp:7.3f}")

"""Complete a prompt with the shipped model pair, DDTree speculation on, and print the figures.

    python examples/generate.py "def fib(n):"
"""

import sys

from treeflash import LLM, SamplingParams

prompt = sys.argv[1] if len(sys.argv) > 1 else "def quicksort(xs):"
llm = LLM()  # the embedded target; pass a path for your own checkpoint
out = llm.generate(prompt, SamplingParams(max_tokens=64))[0]
print(prompt + out.text)
print(out.metrics.get("speculative_decoding", "speculation off"))

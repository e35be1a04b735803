"""treeflash: DFlash + DDTree speculative decoding for DeepSeek-V3 / Kimi-K2 models."""

from treeflash.engine.llm import LLM
from treeflash.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

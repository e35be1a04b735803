import os
import sys
from pathlib import Path

import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).parent))

# The test models are tiny: one intra-op thread avoids oversubscribing CI's 2 cores.
torch.set_num_threads(1)

import os

import pytest
import torch

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Without a GPU, Triton kernels run through the interpreter; the flag must be set before
# anything imports triton.language (transformers' model code can, before a kernel module).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test models are tiny: one intra-op thread avoids oversubscribing CI's 2 cores.
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target (2048 positions) and a real-format drafter with a sliding layer (W=5):
    what bench sweep and doctor run on when no shipped pair or preset is wanted."""
    from helpers.drafter import write_drafter
    from helpers.hf_checkpoints import write_checkpoint

    target = write_checkpoint(tmp_path_factory.mktemp("t") / "m", initializer_range=0.3,
                              max_position_embeddings=2048)
    drafter = write_drafter(tmp_path_factory.mktemp("d") / "dr", hidden_size=64, vocab_size=96,
                            num_target_layers=3, target_layer_ids=(0, 2), block_size=6,
                            mask_token_id=95, layer_types=("sliding_attention", "full_attention"),
                            sliding_window=5)
    return target, drafter

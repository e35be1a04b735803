"""What the tests share, as one package on pytest's path (`pythonpath` in pyproject.toml):
tiny checkpoints written by transformers (`hf_checkpoints`, `k26_checkpoints`), DFlash drafters
(`drafter`), a served LLM (`server`), the speculative and tensor-parallel tests' prompts
(`spec`, `tp`), the training smoke tests' corpus (`train`)."""

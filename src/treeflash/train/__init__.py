"""Training of the embedded model pair: corpus, tokenizer, DeepSeek-V3 target, DFlash drafter.

`treeflash train tokenizer|target|drafter|eval` (see cli.py) runs each stage; the shipped
files under treeflash/assets/ were made with the commands in assets/MODEL_CARD.md.
"""

"""Speculative decoding: draft trees (tree, build), the walk (verify) and metrics."""

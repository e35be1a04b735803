"""Requests, scheduling, the model runner and the `LLM` front end."""

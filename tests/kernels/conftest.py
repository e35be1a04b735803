"""Kernel tests run Triton on the CPU through its interpreter; the flag must precede the
first @triton.jit decoration, so it is set before any test module imports a kernel."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

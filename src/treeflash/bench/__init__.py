"""Benchmarks against the hardware limit: verify kernel roofline, decode sweep, floors, plots."""

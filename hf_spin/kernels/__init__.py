"""Triton kernels for ragged verification (each beside a pure-PyTorch reference)."""

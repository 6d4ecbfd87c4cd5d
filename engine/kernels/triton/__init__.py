"""Triton GPU kernels (they also run on CPU tensors under TRITON_INTERPRET=1, which the tests use)."""

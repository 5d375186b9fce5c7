"""Triton kernels for the speculative-decoding hot path, each beside a torch reference."""

"""Figures and comparisons from tltsim / tltrun result files (matplotlib)."""

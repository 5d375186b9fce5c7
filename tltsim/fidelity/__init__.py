"""Measured runs against the simulator: sim-vs-measured comparison, fitting acceptance and drafter dynamics."""

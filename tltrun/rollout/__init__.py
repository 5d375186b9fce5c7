"""Rollout: the interface, scheduler, torch engine, speculative sampling, vLLM backend, measured-trace writer."""

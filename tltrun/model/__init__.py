"""Models: HF-compatible target transformer, KV cache, EAGLE drafter, tokenizers."""

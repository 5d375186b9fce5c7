"""tltrun: the real runtime — torch rollout engine with lossless speculative decoding, EAGLE
drafter, GRPO with spot drafter training, vLLM backend (see README.md)."""

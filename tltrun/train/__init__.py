"""Training: tasks and rewards, SFT, GRPO, offline and spot drafter training, the multi-worker launcher and its checkpoints."""

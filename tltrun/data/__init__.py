"""Data for ``tltrun train`` and ``tltrun sft``: prompt datasets (``dataset.py``: JSONL, JSON,
Parquet, CSV, ``datasets`` directories, and reasoning-gym tasks through ``gym.py``), rewards run in
a process pool with a per-call timeout (``rewards.py``), and the model directory's tokenizer
(``tokenizer.py``). Only ``tokenizer.py`` imports torch-side libraries; the rest is plain Python so
reward processes start fast."""

"""Tiny random models shared by the tltrun tests (hidden 32-64, 2 layers, vocab ~100): fast on
a 2-core CPU, yet every code path (GQA, RoPE, tree masks, drafter) is exercised."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tltrun.model.config import ModelConfig
from tltrun.model.transformer import Transformer
from tltrun.train.tasks import TaskConfig

VOCAB = 97
EOS = 3

# Tiny matmuls gain nothing from intra-op threads, and on the shared 2-core test machine
# OpenMP spin-waiting makes them ~20x slower under load: run the tltrun tests single-threaded.
torch.set_num_threads(1)


def cuda_param(reason: str):
    """The ``device`` parameter "cuda" of a test that also runs on "cpu": marked gpu (the GPU
    session's ``pytest -m gpu``), skipped with ``needs CUDA: reason`` where there is none."""
    return pytest.param(
        "cuda",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason=f"needs CUDA: {reason}"),
        ],
    )


def tiny_config(**overrides) -> ModelConfig:
    fields = dict(
        model_type="llama",
        vocab_size=VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=12,
        rope_theta=10000.0,
        max_position_embeddings=512,
        eos_token_ids=(EOS,),
        bos_token_id=1,
    )
    fields.update(overrides)
    return ModelConfig(**fields)


def tiny_model(seed: int = 0, dtype: torch.dtype = torch.float32, **overrides) -> Transformer:
    """Random weights with std 0.3 so logits are spread out (greedy argmax rarely near a tie)."""
    torch.manual_seed(seed)
    model = Transformer(tiny_config(**overrides))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                # drawn in logical order: the same values whatever the layout (gemm_layout)
                p.copy_(torch.empty(p.shape, dtype=p.dtype).normal_(0, 0.3))
    return model.to(dtype).eval()


def save_train_model(out: Path, task: TaskConfig) -> Path:
    """The tiny model directory the `tltrun train` tests run on: weights, the built-in task's
    char tokenizer and the task settings (``sft_config.json``), as ``tltrun sft`` writes them."""
    import json
    from dataclasses import asdict

    from tltrun.model.hf_checkpoint import save_hf
    from tltrun.model.tokenizer import CharTokenizer

    tok = CharTokenizer()
    save_hf(tiny_model(seed=0, vocab_size=tok.vocab_size, eos_token_ids=(tok.eos_id,)), out)
    tok.save(out)
    (out / "sft_config.json").write_text(json.dumps({"task": asdict(task)}))
    return out

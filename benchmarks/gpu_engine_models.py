"""The device side of ``benchmarks/bench_gpu_engine.py``: its models, random-weight
transformers of Qwen2.5 preset shapes (``tltsim.cost.specs.MODEL_PRESETS``, built on the device:
no download) or the tiny shape of its ``--smoke``; the HBM roofline's two halves, the bytes a
decode step reads (weights, KV cache per token) and the measured copy bandwidth; whether a
configuration's KV cache fits; random KV contents for an engine's slots; and the reference a
user would otherwise have: the same model through ``transformers``' ``generate()``.

Not run directly (``python benchmarks/bench_gpu_engine.py`` imports it).
"""

from __future__ import annotations

import statistics
import time

import torch
from gpu_engine_timing import SKIPPED, BenchConfig, Budget, release

from tltrun.model.config import ModelConfig
from tltrun.model.transformer import Transformer
from tltsim.cost.specs import MODEL_PRESETS

# the tiny model of --smoke (tests/tiny_models.py's shape)
SMOKE_SHAPE = dict(vocab_size=97, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=12)  # fmt: skip
# fraction of free device memory one configuration may take (weights, KV cache, activations)
MEMORY_FRACTION = 0.85


def model_config(shape: str) -> ModelConfig:
    if shape == "tiny":
        return ModelConfig(model_type="qwen2", attention_bias=True, max_position_embeddings=4096,
                           **SMOKE_SHAPE)  # fmt: skip
    spec = MODEL_PRESETS[shape]
    # rope_theta 1e6, max_position_embeddings 32768: the Qwen2.5 config.json files
    return ModelConfig(
        model_type="qwen2",
        vocab_size=spec.vocab_size,
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        rope_theta=1e6,
        attention_bias=spec.has_qkv_bias,
        tie_word_embeddings=spec.tie_word_embeddings,
        max_position_embeddings=32768,
    )


def build_model(shape: str, device: torch.device, dtype: torch.dtype, seed: int) -> Transformer:
    """Random weights (std 0.02, the Qwen2 initializer_range), made directly on the device."""
    torch.manual_seed(seed)
    with torch.device(device):
        model = Transformer(model_config(shape))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02)
    return model.to(dtype).eval()


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * elem


def weight_bytes_per_token(model: Transformer) -> int:
    """Parameter bytes one decode step reads: all of them, but one row of an untied embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.config.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total -= (emb.shape[0] - 1) * emb.shape[1] * emb.element_size()
    return total


def fits(model: Transformer, batch: int, tokens: int, extra_bytes: int, device) -> bool:
    if device.type != "cuda":
        return True
    dtype = model.lm_head.weight.dtype
    need = batch * tokens * kv_bytes_per_token(model.config, dtype) + extra_bytes
    return need < MEMORY_FRACTION * torch.cuda.mem_get_info(device)[0]


def copy_bandwidth(device: torch.device, num_bytes: int, reps: int = 10) -> float:
    """Bytes read + written per second by ``dst.copy_(src)`` (median of ``reps``)."""
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(reps + 2):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times)  # (the upper middle of 10 was taken)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def hf_generate_s(hf, ids: torch.Tensor, num_new: int, device) -> float:
    """Seconds of one greedy ``generate()`` of exactly ``num_new`` tokens per sequence."""
    sync(device)
    start = time.perf_counter()
    with torch.no_grad():
        hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                    max_new_tokens=num_new, min_new_tokens=num_new, pad_token_id=0)  # fmt: skip
    sync(device)
    return time.perf_counter() - start


def bench_hf(cfg: BenchConfig, device, dtype, budget: Budget, rows: list[dict]) -> list[dict]:
    try:
        import transformers
    except ImportError:
        return [{"shape": "all", "note": "transformers is not installed"}]
    for shape in cfg.shapes:
        model = build_model(shape, device, dtype, cfg.seed)
        hf_cfg = transformers.Qwen2Config(**model.config.to_hf_dict())
        with torch.device(device):
            hf = transformers.Qwen2ForCausalLM(hf_cfg).to(dtype).eval()
        missing, unexpected = hf.load_state_dict(model.state_dict(), strict=False)
        if unexpected or set(missing) - {"lm_head.weight"}:  # the tied head is the embedding
            raise RuntimeError(f"{shape}: transformers names differ: {missing}, {unexpected}")
        del model
        gen = torch.Generator(device).manual_seed(cfg.seed)
        for batch in cfg.hf_batches:
            if budget.is_over:
                rows.append({"shape": shape, "batch": batch, "note": SKIPPED})
                continue
            ids = torch.randint(hf_cfg.vocab_size, (batch, cfg.hf_context), generator=gen,
                                device=device)  # fmt: skip
            hf_generate_s(hf, ids, 2, device)  # warm-up
            first = hf_generate_s(hf, ids, 1, device)
            full = hf_generate_s(hf, ids, cfg.hf_new_tokens, device)
            decode_s = max(full - first, 1e-9)
            rows.append({"shape": shape, "batch": batch, "context": cfg.hf_context,
                         "tokens_per_s": batch * (cfg.hf_new_tokens - 1) / decode_s})  # fmt: skip
        del hf
        release(device)
    return rows

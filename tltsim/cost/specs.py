"""Model, drafter and hardware specifications with cited presets (inputs of the roofline model).

``ModelSpec`` is a Llama/Qwen2-style dense decoder (GQA, SwiGLU, RMSNorm); ``DrafterSpec`` is an
EAGLE-1 drafter built on a target; ``HardwareSpec`` (``tltsim.cost.hardware``, re-exported here) is
one GPU. ``tltsim.cost.roofline.RooflineCost`` turns them into seconds. Every preset number is
cited where it is set.

    from tltsim.cost.specs import get_model, get_hardware
    get_model("Qwen2.5-7B").num_params          # 7_615_616_512
    get_hardware("H100-SXM").hbm_bytes_per_s    # 3.35e12
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from tltsim.cost.hardware import HARDWARE_PRESETS, HardwareSpec, get_hardware

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "float8_e4m3fn": 1}


@dataclass(frozen=True)
class ModelSpec:
    """Shape of a dense decoder-only transformer, as in its Hugging Face ``config.json``."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool = False
    has_qkv_bias: bool = False  # Qwen2 has q/k/v biases; Llama does not
    bytes_per_param: int = 2  # bf16 weights
    kv_bytes_per_elem: int = 2  # bf16 KV cache

    def __post_init__(self) -> None:
        for field_name in (
            "num_layers",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_kv_heads",
            "head_dim",
            "vocab_size",
            "bytes_per_param",
            "kv_bytes_per_elem",
        ):
            value = getattr(self, field_name)
            if not (math.isfinite(value) and value >= 1):  # not (nan >= 1): NaN is refused
                raise ValueError(f"ModelSpec {self.name!r}: {field_name} must be >= 1, got {value}")
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(
                f"ModelSpec {self.name!r}: num_attention_heads={self.num_attention_heads} is not a multiple of num_kv_heads={self.num_kv_heads}"
            )

    @property
    def q_width(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """q, k, v, o projections (+ q/k/v biases), SwiGLU MLP (gate, up, down), two RMSNorms."""
        h = self.hidden_size
        attn = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        bias = self.q_width + 2 * self.kv_width if self.has_qkv_bias else 0
        return attn + bias + 3 * h * self.intermediate_size + 2 * h

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def num_params(self) -> int:
        """Stored parameters: embedding, layers, final norm, LM head unless tied."""
        head = 0 if self.tie_word_embeddings else self.lm_head_params
        return (
            self.num_layers * self.layer_params
            + self.vocab_size * self.hidden_size
            + self.hidden_size
            + head
        )

    @property
    def matmul_params(self) -> int:
        """Parameters a token multiplies through in a forward pass: every layer plus the LM head
        (tied or not). The embedding is a lookup, not a matmul. Forward FLOPs = 2 x this."""
        return self.num_layers * self.layer_params + self.lm_head_params + self.hidden_size

    @property
    def weight_bytes(self) -> int:
        """Weight bytes one forward pass streams from HBM (the embedding table is not streamed:
        only the rows of the batch's tokens are read, which is negligible)."""
        return self.bytes_per_param * self.matmul_params

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over all layers."""
        return 2 * self.num_layers * self.kv_width * self.kv_bytes_per_elem

    @property
    def attn_flops_per_pair(self) -> int:
        """FLOPs for one (query token, key token) pair over all layers: QK^T and AV, each
        2 x head_dim per head."""
        return 4 * self.num_layers * self.q_width

    def forward_flops_per_token(self, context_tokens: float) -> float:
        """2 x params for the matmuls + attention to ``context_tokens`` keys. Kaplan et al. 2020
        (arXiv 2001.08361, Table 1) count 2 n_layer n_ctx d_attn for the attention scores; the
        value product A V is as large, hence 4 per (query, key) pair per layer and head dim."""
        return 2.0 * self.matmul_params + self.attn_flops_per_pair * context_tokens

    def shape_differences(self, other: ModelSpec) -> list[str]:
        """``"field mine vs other's"`` for each shape field (not the name) the two differ in."""
        return [
            f"{f.name} {getattr(self, f.name)} vs {getattr(other, f.name)}"
            for f in fields(self)
            if f.name != "name" and getattr(self, f.name) != getattr(other, f.name)
        ]

    @classmethod
    def from_hf_config(cls, config: Mapping[str, Any], name: str | None = None) -> ModelSpec:
        """Build from a Hugging Face ``config.json`` dict (Llama / Qwen2 / Mistral layout; a
        nested ``text_config`` is used when present). A missing field raises one ValueError
        naming it."""
        cfg = (
            config.get("text_config", config)
            if isinstance(config.get("text_config"), Mapping)
            else config
        )

        where = "config.json: " + ("text_config: " if cfg is not config else "")

        def need(key: str, default: int | None = None) -> int:
            # a multimodal config's text_config may leave a field to the top level (vocab_size)
            block = cfg if key in cfg or key not in config else config
            if block.get(key) is None and default is not None:  # absent or null: the default
                return default
            if key not in block:
                raise ValueError(f"{where}missing field {key!r} (expected an integer)")
            value = block[key]
            if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value < 2**31:
                raise ValueError(
                    f"{where}field {key!r} must be an integer in [1, 2^31), got {value!r}"
                )
            return value

        # A mixture-of-experts model reads a few experts' weights per token, not all of them:
        # priced as dense it would be off by the expert count, silently. Refused instead: any
        # expert count above 1 (num_experts, num_local_experts, n_routed_experts,
        # moe_num_experts, num_experts_per_tok, ...), here or in a nested block (DBRX's
        # ffn_config).
        nested = [v for v in cfg.values() if isinstance(v, Mapping)]
        for block in (cfg, *nested):
            for key, experts in block.items():
                if (
                    "expert" in str(key).lower()
                    and isinstance(experts, int)
                    and not isinstance(experts, bool)
                    and experts > 1
                ):
                    raise ValueError(
                        f"{where}field {key!r} = {experts}: a mixture-of-experts model; "
                        "the cost model prices dense decoders only"
                    )
        if cfg.get("quantization_config") or config.get("quantization_config"):
            raise ValueError(
                f"{where}field 'quantization_config': a quantized checkpoint (its weight bytes "
                "are not its dtype's); give the unquantized model's config.json"
            )
        hidden, heads = need("hidden_size"), need("num_attention_heads")
        model_type = str(cfg.get("model_type", ""))
        dtype = str(cfg.get("torch_dtype", cfg.get("dtype", "bfloat16")))
        return cls(
            name=name or str(cfg.get("_name_or_path", model_type or "model")),
            num_layers=need("num_hidden_layers"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_attention_heads=heads,
            num_kv_heads=need("num_key_value_heads", heads),
            head_dim=need("head_dim", hidden // heads),
            vocab_size=need("vocab_size"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            # Qwen2 puts biases on q/k/v without saying so in config.json; Llama says attention_bias.
            has_qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            bytes_per_param=DTYPE_BYTES.get(dtype, 2),
        )

    @classmethod
    def from_hf_config_file(cls, path: str | Path, name: str | None = None) -> ModelSpec:
        path = Path(path)
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
            raise ValueError(f"{path}: cannot read a JSON config ({err})") from None
        except RecursionError:
            raise ValueError(f"{path}: JSON config nested too deeply to parse") from None
        if not isinstance(config, Mapping):
            raise ValueError(f"{path}: expected a JSON object (a Hugging Face config.json)")
        try:
            # a config.json is named after its model directory, another file after itself
            default = path.parent.name if path.name == "config.json" else path.stem
            return cls.from_hf_config(config, name=name or default)
        except ValueError as err:
            raise ValueError(f"{path}: {str(err).removeprefix('config.json: ')}") from None


@dataclass(frozen=True)
class DrafterSpec:
    """EAGLE-1 drafter (arXiv 2401.15077, Sec. 4): ``fc(cat(embed(x_t+1), h_t))`` from 2h to h,
    then ``num_layers`` decoder layers of the target's shape; the token embedding and the LM head
    are shared with the target and frozen. The LM head (vocab x hidden) dominates a drafter
    forward for large vocabularies: for Qwen2.5-7B it is 545M of the 804M parameters streamed."""

    target: ModelSpec
    num_layers: int = 1
    draft_vocab_size: int | None = (
        None  # None: the target's full LM head (EAGLE-1/2); smaller: a hot-token head
    )
    has_fc_bias: bool = True  # EAGLE-1's fc layer carries a bias

    def __post_init__(self) -> None:
        if self.num_layers < 1:
            raise ValueError(f"DrafterSpec: num_layers must be >= 1, got {self.num_layers}")
        if (
            self.draft_vocab_size is not None
            and not 1 <= self.draft_vocab_size <= self.target.vocab_size
        ):
            raise ValueError(
                f"DrafterSpec: draft_vocab_size must be in 1..{self.target.vocab_size}, got {self.draft_vocab_size}"
            )

    @property
    def vocab_size(self) -> int:
        return self.draft_vocab_size or self.target.vocab_size

    @property
    def fc_params(self) -> int:
        h = self.target.hidden_size
        return 2 * h * h + (h if self.has_fc_bias else 0)

    @property
    def trainable_params(self) -> int:
        return self.fc_params + self.num_layers * self.target.layer_params

    @property
    def lm_head_params(self) -> int:
        return self.vocab_size * self.target.hidden_size

    @property
    def matmul_params(self) -> int:
        return self.trainable_params + self.lm_head_params

    @property
    def weight_bytes(self) -> int:
        return self.target.bytes_per_param * self.matmul_params

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.target.kv_width * self.target.kv_bytes_per_elem

    @property
    def attn_flops_per_pair(self) -> int:
        return 4 * self.num_layers * self.target.q_width


# ---------------------------------------------------------------------------------------------
# Model presets: numbers copied from each model's published Hugging Face config.json.
# ---------------------------------------------------------------------------------------------

MODEL_PRESETS: dict[str, ModelSpec] = {
    # huggingface.co/Qwen/Qwen2.5-0.5B/blob/main/config.json (model card: 0.49B parameters)
    "Qwen2.5-0.5B": ModelSpec(
        "Qwen2.5-0.5B",
        num_layers=24,
        hidden_size=896,
        intermediate_size=4864,
        num_attention_heads=14,
        num_kv_heads=2,
        head_dim=64,
        vocab_size=151936,
        tie_word_embeddings=True,
        has_qkv_bias=True,
    ),
    # huggingface.co/Qwen/Qwen2.5-1.5B/blob/main/config.json (model card: 1.54B parameters)
    "Qwen2.5-1.5B": ModelSpec(
        "Qwen2.5-1.5B",
        num_layers=28,
        hidden_size=1536,
        intermediate_size=8960,
        num_attention_heads=12,
        num_kv_heads=2,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
        has_qkv_bias=True,
    ),
    # huggingface.co/Qwen/Qwen2.5-7B/blob/main/config.json (model card: 7.61B parameters);
    # DeepSeek-R1-Distill-Qwen-7B (a TLT target) has the same shape.
    "Qwen2.5-7B": ModelSpec(
        "Qwen2.5-7B",
        num_layers=28,
        hidden_size=3584,
        intermediate_size=18944,
        num_attention_heads=28,
        num_kv_heads=4,
        head_dim=128,
        vocab_size=152064,
        has_qkv_bias=True,
    ),
    # huggingface.co/Qwen/Qwen2.5-32B/blob/main/config.json (model card: 32.5B parameters;
    # 32,763,876,352 counted from the config, embedding and LM head included)
    "Qwen2.5-32B": ModelSpec(
        "Qwen2.5-32B",
        num_layers=64,
        hidden_size=5120,
        intermediate_size=27648,
        num_attention_heads=40,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=152064,
        has_qkv_bias=True,
    ),
    # huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json
    "Llama-3.1-8B": ModelSpec(
        "Llama-3.1-8B",
        num_layers=32,
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
    # huggingface.co/Qwen/Qwen3-8B/blob/main/config.json. Not read on that page itself: checked
    # against a verbatim copy ("Copy config.json from Qwen/Qwen3-8B", huggingface.co/thejaminator/
    # qwen-hook-layer-9, commit 478fb72) and github.com/Chen-Oliver/qwen3-8b-base config.json
    # (Qwen3-8B-Base, same shape); all fields below agree. Counted: 8.19B parameters, 6.95B
    # without embedding and LM head (the card's 8.2B / 6.95B as quoted by third parties; we did
    # not read the card). Qwen3 has no q/k/v bias (attention_bias false) but a per-head q/k
    # RMSNorm (2 x 128 weights per layer) that ModelSpec does not count: negligible.
    "Qwen3-8B": ModelSpec(
        "Qwen3-8B",
        num_layers=36,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
    ),
    # Qwen3-1.7B (Qwen/Qwen3-1.7B): the shape of stanford-crfm/levanter's qwen3_1_7b config (hidden
    # 2048, intermediate 6144, 16 heads, 8 KV heads, 28 layers) with Qwen3's head_dim 128 and
    # vocabulary 151936. Checked against what a measurement of it reports (adixg/vllm-specdecode-
    # cost-model FINDINGS.md): "28 layers, 8 KV heads, head_dim 128 -> 112 KB KV per token" and
    # "1.72B params": 1.72B counts the embedding once, so the LM head is tied (untied: 2.03B).
    "Qwen3-1.7B": ModelSpec(
        "Qwen3-1.7B",
        num_layers=28,
        hidden_size=2048,
        intermediate_size=6144,
        num_attention_heads=16,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=151936,
        tie_word_embeddings=True,
    ),
    # huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json (Llama-3.3-70B, a TLT
    # target, has the same shape)
    "Llama-3.1-70B": ModelSpec(
        "Llama-3.1-70B",
        num_layers=80,
        hidden_size=8192,
        intermediate_size=28672,
        num_attention_heads=64,
        num_kv_heads=8,
        head_dim=128,
        vocab_size=128256,
    ),
}


def is_model_path(name: str) -> bool:
    """Whether a model name is a path (a ``*.json`` file, or a directory: an existing one, or
    any name with a path separator) rather than a preset name."""
    if name in MODEL_PRESETS:
        return False
    return name.lower().endswith(".json") or "/" in name or os.sep in name or Path(name).is_dir()


def model_config_file(name: str) -> Path:
    """The ``config.json`` a model path names (the file, or the one in the directory)."""
    path = Path(name)
    return path / "config.json" if not name.lower().endswith(".json") else path


def get_model(name: str) -> ModelSpec:
    """A preset by name, else the model a Hugging Face ``config.json`` describes: ``name`` is
    the file (``*.json``) or a model directory holding one (named after the directory)."""
    if name in MODEL_PRESETS:
        return MODEL_PRESETS[name]
    if is_model_path(name):
        config = model_config_file(name)
        if config.parent.is_dir() and not config.exists() and config.name == "config.json":
            raise ValueError(f"{config.parent}: no config.json there (not a model directory)")
        # priced in bf16, the dtype RL rollouts run in (veRL's vLLM/SGLang and tltrun on GPUs),
        # whatever the checkpoint was saved in (an FSDP-merged fp32 one cost 1.6x the time)
        return dataclasses.replace(ModelSpec.from_hf_config_file(config), bytes_per_param=2)
    raise ValueError(
        f"unknown model preset {name!r}; expected one of {', '.join(MODEL_PRESETS)}, "
        "or a Hugging Face config.json (or the model directory holding it)"
    )


__all__ = [
    "DrafterSpec",
    "HARDWARE_PRESETS",
    "HardwareSpec",
    "MODEL_PRESETS",
    "ModelSpec",
    "get_hardware",
    "get_model",
    "is_model_path",
    "model_config_file",
]

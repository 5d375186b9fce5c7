"""The model's configuration: a Hugging Face ``config.json`` (Llama / Qwen2 / Qwen3; RoPE scaling
"default", "linear" or "llama3") read into a ``ModelConfig`` and written back, the error a bad
checkpoint raises, and the check that a ``--device`` exists on this machine.

    cfg = read_config("./Qwen2.5-0.5B-Instruct")   # CheckpointError names file and field

The model built from it is ``tltrun.model.transformer.Transformer``; its weights are read and
written by ``tltrun.model.hf_checkpoint``. Try it: ``python -m pytest tests/test_model.py -q``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tltsim.errors import TLTError
from tltsim.jsonio import read_json

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
# max_position_embeddings of a config.json without one: transformers' LlamaConfig / Qwen2Config
# / Qwen3Config
MAX_POSITIONS_DEFAULT = {"llama": 2048, "qwen2": 32768, "qwen3": 32768}
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
ROPE_KINDS = ("default", "linear", "llama3")


class CheckpointError(TLTError, ValueError):
    """Bad checkpoint directory or config. ``str(err)`` is one line naming file and field."""


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling as in Hugging Face ``rope_parameters`` / legacy ``rope_scaling``."""

    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.kind not in ROPE_KINDS:
            raise ValueError(
                f"rope type {self.kind!r} is not supported (expected one of {ROPE_KINDS})"
            )
        if self.factor <= 0:
            raise ValueError(f"rope scaling factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    model_type: str  # "llama" | "qwen2" | "qwen3" (Qwen2's layout, no biases, q/k norms)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling = RopeScaling()
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} not supported (expected one of {SUPPORTED_MODEL_TYPES})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            # int32 bound: torch sizes are int64 and a product of two larger ones overflowed
            if not 1 <= getattr(self, name) < 2**31:
                raise ValueError(f"{name} must be in [1, 2^31), got {getattr(self, name)}")
        if self.head_dim % 2:  # rotary embeddings rotate pairs (transformers refuses it too)
            raise ValueError(f"head_dim must be even (RoPE rotates pairs), got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

    @property
    def has_qk_norm(self) -> bool:
        """Qwen3: each head's query and key RMS-normalised (``q_norm``/``k_norm``, weights of
        head_dim) after the projection, before RoPE (transformers' Qwen3Attention)."""
        return self.model_type == "qwen3"

    @property
    def tied_names(self) -> frozenset[str]:
        """Weights that are another's (a tied LM head is the embedding): a checkpoint need not
        store them, and a weight sync copies the embedding alone."""
        return frozenset({"lm_head.weight"} if self.tie_word_embeddings else ())

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """Read a Hugging Face ``config.json`` dict (transformers 4.x or 5.x rope layout)."""

        def need(key: str) -> Any:
            if key not in d:
                raise CheckpointError(f"{source}: missing field {key!r}")
            return d[key]

        model_type = need("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"{source}: model_type {model_type!r} not supported (expected one of {SUPPORTED_MODEL_TYPES})"
            )
        _check_computable(d, source)
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = d.get("eos_token_id")
        eos_ids = (
            () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        )
        qkv_bias = _qkv_bias(d, model_type, source)
        theta, scaling = _parse_rope(d, source)
        try:
            return cls(
                model_type=model_type,
                vocab_size=int(need("vocab_size")),
                hidden_size=hidden,
                intermediate_size=int(need("intermediate_size")),
                num_hidden_layers=int(need("num_hidden_layers")),
                num_attention_heads=num_heads,
                num_key_value_heads=int(d.get("num_key_value_heads") or num_heads),
                head_dim=int(d.get("head_dim") or hidden // num_heads),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=theta,
                rope_scaling=scaling,
                attention_bias=qkv_bias,
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                # absent: transformers' default of the model type (LlamaConfig 2048,
                # Qwen2Config 32768)
                max_position_embeddings=int(
                    d.get("max_position_embeddings", MAX_POSITIONS_DEFAULT[model_type])
                ),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except ValueError as err:
            raise CheckpointError(f"{source}: {err}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that transformers (4.x and 5.x) and vLLM load. One exception: a
        Llama with q/k/v-only biases (``qkv_bias``, vLLM's form, as this project's drafter
        export) has no transformers equivalent, which loads it without them (and says so)."""
        arch = ARCHITECTURES[self.model_type]
        rope: dict[str, Any] | None = None
        if self.rope_scaling.kind != "default":
            rope = {"rope_type": self.rope_scaling.kind, "factor": self.rope_scaling.factor}
            if self.rope_scaling.kind == "llama3":
                rope.update(
                    low_freq_factor=self.rope_scaling.low_freq_factor,
                    high_freq_factor=self.rope_scaling.high_freq_factor,
                    original_max_position_embeddings=self.rope_scaling.original_max_position_embeddings,
                )
        eos: Any = (
            list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0]
        )
        return {
            "architectures": [arch],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            # Legacy layout (rope_theta + rope_scaling): transformers 5 converts it on load,
            # vLLM and transformers 4 read it directly.
            "rope_theta": self.rope_theta,
            "rope_scaling": rope,
            # Hugging Face's and vLLM's Llama read attention_bias as q/k/v AND o biases; a
            # q/k/v-only bias is vLLM's qkv_bias there (Qwen2 has q/k/v biases only)
            "attention_bias": self.attention_bias and self.model_type == "qwen2",
            **({"qkv_bias": True} if self.attention_bias and self.model_type == "llama" else {}),
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos if self.eos_token_ids else None,
        }


# Activations the MLP computes: SwiGLU's silu (swish is its other name).
ACTIVATIONS = ("silu", "swish")


def _check_computable(d: dict[str, Any], source: str) -> None:
    """Refuse what the Llama/Qwen2/Qwen3 layout here cannot compute, rather than load it and
    compute something else: a sliding window, another activation, MLP biases, quantized
    weights."""
    if d.get("use_sliding_window"):
        raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
    layer_types = d.get("layer_types") or []  # transformers 5 (Qwen2/Qwen3): one per layer
    if not isinstance(layer_types, list) or any(t != "full_attention" for t in layer_types):
        raise CheckpointError(
            f"{source}: layer_types {layer_types!r} not supported (every layer must be "
            "'full_attention': no sliding-window layers)"
        )
    act = d.get("hidden_act", "silu")
    if act not in ACTIVATIONS:
        raise CheckpointError(
            f"{source}: hidden_act {act!r} not supported (the MLP computes SwiGLU: silu)"
        )
    if d.get("mlp_bias"):
        raise CheckpointError(f"{source}: mlp_bias=true (biases on the MLP) is not supported")
    quant = d.get("quantization_config")
    if quant:
        method = quant.get("quant_method", "?") if isinstance(quant, dict) else quant
        raise CheckpointError(
            f"{source}: a quantized checkpoint (quant_method {method!r}) is not supported; "
            "use the unquantized (bf16/fp16/fp32) weights"
        )


def _qkv_bias(d: dict[str, Any], model_type: str, source: str) -> bool:
    """Whether q/k/v carry a bias. A Qwen2 always has them: Hugging Face's Qwen2Attention and
    vLLM's Qwen2 build q/k/v with bias=True whatever the config says (most configs carry no
    attention_bias; a fine-tune's may say false and still ship the biases). Llama's
    attention_bias puts a bias on o_proj too (Hugging Face and vLLM), which this layout lacks;
    vLLM's qkv_bias (our drafter export) is the q/k/v-only form."""
    if model_type == "qwen2":
        return True
    if d.get("attention_bias") or d.get("bias"):
        name = "Llama" if model_type == "llama" else "Qwen3"
        raise CheckpointError(
            f"{source}: a {name} with attention_bias=true (biases on q, k, v and o_proj) is not "
            "supported"
        )
    if model_type == "qwen3" and d.get("qkv_bias"):  # (vLLM's Llama-only form)
        raise CheckpointError(f"{source}: qkv_bias=true is a Llama field, not a Qwen3 one")
    return bool(d.get("qkv_bias", False))


def _parse_rope(d: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    params = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
    for key, value in (("rope_parameters", params), ("rope_scaling", legacy)):
        if not isinstance(value, dict):
            raise CheckpointError(
                f"{source}: field {key!r}: expected an object, got {type(value).__name__}"
            )
    if params and legacy and not _same_rope(params, legacy):
        # transformers lets rope_scaling replace rope_parameters whole (its theta then falls
        # back to rope_theta or 10000): reading either one gave logits off by up to ~3
        raise CheckpointError(
            f"{source}: fields 'rope_parameters' and 'rope_scaling' disagree ({params} vs "
            f"{legacy}); keep one of them"
        )
    theta = float(params.get("rope_theta", d.get("rope_theta", 10000.0)))
    spec = params if params.get("rope_type", "default") != "default" else legacy
    kind = spec.get("rope_type", spec.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise CheckpointError(
            f"{source}: rope type {kind!r} not supported (expected one of {ROPE_KINDS})"
        )
    scaling = RopeScaling(
        kind=kind,
        factor=float(spec.get("factor", 1.0)),
        low_freq_factor=float(spec.get("low_freq_factor", 1.0)),
        high_freq_factor=float(spec.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            # as transformers: without either field, LlamaConfig's default max_position_embeddings
            spec.get("original_max_position_embeddings", d.get("max_position_embeddings", 2048))
        ),
    )
    return theta, scaling


def _same_rope(params: dict[str, Any], legacy: dict[str, Any]) -> bool:
    """Whether a legacy rope_scaling says what rope_parameters says (transformers 5 writes
    both, the same, for some models): the type and every field the legacy one gives."""
    kind = legacy.get("rope_type", legacy.get("type", "default"))
    if kind != params.get("rope_type", "default"):
        return False
    return all(params.get(k) == v for k, v in legacy.items() if k not in ("type", "rope_type"))


def read_config(model_dir: str | Path) -> ModelConfig:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{model_dir}: no config.json (expected a Hugging Face model directory)"
        )
    raw = read_json(path, "model config.json", CheckpointError)
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    try:
        return ModelConfig.from_hf_dict(raw, source=str(path))
    except CheckpointError:
        raise
    except (TypeError, ValueError, OverflowError) as err:  # int("x"), int(None), int(inf)
        raise CheckpointError(f"{path}: {err}") from None


def check_device(device: str | torch.device) -> None:
    """Raise a one-line ValueError unless ``device`` names a torch device this machine has
    (``--device cuda`` without CUDA was an AssertionError traceback deep in torch). The config
    dataclasses that hold a device call it in ``__post_init__``."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(
            f"device {device!r}: not a torch device ({str(err).splitlines()[0]})"
        ) from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available on this machine")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(
                f"device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif dev.type not in ("cpu", "meta"):
        raise ValueError(f"device {device!r}: expected cpu, cuda or cuda:N")

"""Llama / Qwen2-style decoder (RMSNorm, RoPE, SwiGLU, grouped-query attention) that loads and
saves Hugging Face checkpoints (``config.json`` + ``model.safetensors`` or a sharded
``model.safetensors.index.json``) and matches ``transformers``' logits on the same weights.

Parameter names are exactly Hugging Face's (``model.layers.0.self_attn.q_proj.weight`` ...), so
a state dict moves unchanged between this model, ``transformers`` and vLLM (GRPO weight sync).

Attention is delegated to an *attention context* passed into ``forward``: the context decides
where keys/values come from and go to (no cache for training, the slot KV cache of
``tltrun.model.kvcache`` for rollout, a side buffer for draft trees in ``tltrun.model.drafter``). The model
itself holds no per-call state.

``forward`` returns ``(logits, hidden)``; ``hidden`` is the last layer's output AFTER the final
RMSNorm, i.e. the vector the LM head multiplies. That is the feature EAGLE-1 trains its drafter
on (EAGLE's ``ea_model`` feeds ``base_model.model(...)[0]``, which Hugging Face returns after
``model.norm``; vLLM's EAGLE proposer passes the same post-norm hidden state).

Try it: ``python -m pytest tests/test_model.py -q``.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from tltsim.errors import TLTError, UsageError
from tltsim.jsonio import read_json

SUPPORTED_MODEL_TYPES = ("llama", "qwen2")
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
    model_type: str  # "llama" | "qwen2"
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
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )

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
        if d.get("use_sliding_window"):
            raise CheckpointError(f"{source}: use_sliding_window=true is not supported")
        num_heads = int(need("num_attention_heads"))
        hidden = int(need("hidden_size"))
        eos = d.get("eos_token_id")
        eos_ids = (
            () if eos is None else tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        )
        # Qwen2 always has q/k/v bias but its config carries no attention_bias field.
        default_bias = model_type == "qwen2"
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
                attention_bias=bool(d.get("attention_bias", default_bias)),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                bos_token_id=d.get("bos_token_id"),
                eos_token_ids=eos_ids,
            )
        except ValueError as err:
            raise CheckpointError(f"{source}: {err}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """A ``config.json`` that transformers (4.x and 5.x) and vLLM load."""
        arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[self.model_type]
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
            "attention_bias": self.attention_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": eos if self.eos_token_ids else None,
        }


def _parse_rope(d: dict[str, Any], source: str) -> tuple[float, RopeScaling]:
    params = d.get("rope_parameters") or {}
    legacy = d.get("rope_scaling") or {}
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
            spec.get("original_max_position_embeddings", d.get("max_position_embeddings", 8192))
        ),
    )
    return theta, scaling


# ---------------------------------------------------------------------------------------------
# Layers
# ---------------------------------------------------------------------------------------------


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse RoPE frequencies (D/2,) in float32, with linear / llama3 scaling."""
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    s = cfg.rope_scaling
    if s.kind == "linear":
        return inv / s.factor
    if s.kind == "llama3":
        # Llama 3.1 "frequency-dependent" scaling: long wavelengths divided by factor, short
        # ones kept, a smooth blend in between (Meta's Llama 3.1 release; HF rope utils).
        old_len = s.original_max_position_embeddings
        low_wavelen = old_len / s.low_freq_factor
        high_wavelen = old_len / s.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / s.factor, inv)
        smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
        blended = (1 - smooth) * scaled / s.factor + smooth * scaled
        is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(is_medium, blended, scaled)
    return inv


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32 as Hugging Face does, then cast back (one fused op, not seven:
        # per-op overhead is a visible share of a batch-1 decode step on CPU).
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)


class AttentionContext(Protocol):
    """Where keys/values live. ``q`` (B,H,T,D) and ``k``/``v`` (B,Hkv,T,D) are post-RoPE."""

    def attend(
        self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> torch.Tensor: ...


@dataclass(frozen=True)
class CausalContext:
    """No cache: plain causal attention over the T tokens given (training, reference forward).

    Right padding is harmless: a valid query never attends to a later (padded) key.
    """

    def attend(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1]
        )


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        c, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(c, self.num_heads * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(c, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(c, self.num_kv_heads * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(self.num_heads * d, c, bias=False)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B,H,T,D)
        k = (
            self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        )  # (B,Hkv,T,D)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos, sin = cos[:, None], sin[:, None]  # (B,1,T,D)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        out = ctx.attend(self.layer, q, k, v)  # (B,H,T,D)
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block. ``has_input_norm=False`` is EAGLE's first drafter layer (its input is the
    fc projection, which EAGLE and vLLM's ``llama_eagle.py`` do not normalise)."""

    def __init__(self, cfg: ModelConfig, layer: int, has_input_norm: bool = True):
        super().__init__()
        self.input_layernorm: nn.Module = (
            RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if has_input_norm else nn.Identity()
        )
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, ctx: AttentionContext
    ) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin, ctx)
        return h + self.mlp(self.post_attention_layernorm(h))


class Rotary(nn.Module):
    """cos/sin tables for arbitrary (B,T) positions (tree nodes sit at root position + depth)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # A plain attribute, not a buffer: ``module.to(bfloat16)`` must not round the
        # frequencies (vLLM, too, builds its cos/sin cache in float32).
        self.inv_freq = rope_inv_freq(cfg)  # (D/2,) float32

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.inv_freq.device != positions.device:
            # moved once and kept: a host-to-device copy per forward cannot be captured in a
            # CUDA graph (tltrun.rollout.graphs), and costs a transfer per step besides
            self.inv_freq = self.inv_freq.to(positions.device)  # (D/2,) float32
        freqs = positions[..., None].float() * self.inv_freq  # (B,T,D/2) in float32
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------


def gemm_layout(module: nn.Module) -> nn.Module:
    """Store every ``nn.Linear`` weight of ``module`` column-major (in place; same shape, names
    and values, strides ``(1, out_features)``) and return ``module``.

    ``F.linear(x, W)`` computes ``x @ W.T``; with ``W`` column-major, ``W.T`` is a row-major
    (in, out) matrix, and MKL's fp32 CPU GEMM is faster on it for the few-row inputs of
    decoding and verification. ``benchmarks/bench_gemm_layout.py`` on this project's CPU (one
    thread, torch 2.13 + MKL 2024.2, 512 -> 1376, weights in cache): 4 rows 267 -> 180 us,
    8 rows 411 -> 234 us, 16 rows 537 -> 339 us, 80 rows 1.21x; 1 row and >= 256 rows about
    unchanged. Whole rollouts gain less where the weights stream from memory (its engine rows:
    0.95-1.11x on the 8-layer hidden-512 model, within this machine's noise).
    Everything that copies into a weight (``load_state_dict``, weight sync) keeps the layout;
    writers that need contiguous tensors (safetensors, vLLM) already call ``.contiguous()``;
    gradients reduced across workers are written back in it (``reduce_grads``).
    GPUs' GEMMs take either layout at the same speed (a transpose flag)."""
    for m in module.modules():
        if isinstance(m, nn.Linear) and m.weight.is_contiguous():
            m.weight.data = m.weight.data.t().contiguous().t()
    return module


def reduce_grads(params: list[nn.Parameter], reduce: Callable[[torch.Tensor], Any]) -> None:
    """Pass the gradients of ``params`` (zeros where a parameter has none) through ``reduce``
    as ONE flat tensor (one collective, not one per parameter; ``reduce`` works in place, e.g.
    an all-reduce) and write them back, each in its parameter's layout (``gemm_layout``)."""
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    reduce(flat)
    offset = 0
    for p in params:
        p.grad = torch.empty_like(p).copy_(flat[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Transformer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        self.rotary = Rotary(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        gemm_layout(self)
        # Activation checkpointing (``tltrun train --gradient-checkpointing``): in training mode
        # each decoder layer keeps only its input and recomputes its activations in the backward
        # pass — layer activations no longer grow with depth, for one more forward of compute.
        self.is_gradient_checkpointing = False

    def forward(
        self,
        input_ids: torch.Tensor,  # (B,T)
        positions: torch.Tensor,  # (B,T) RoPE positions
        ctx: AttentionContext,
        logit_index: torch.Tensor | None = None,  # (B,K): only these positions get logits
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model.embed_tokens(input_ids)  # (B,T,C)
        cos, sin = self.rotary(positions, x.dtype)
        is_recomputing = (
            self.is_gradient_checkpointing and self.training and torch.is_grad_enabled()
        )
        for layer in self.model.layers:
            if is_recomputing:
                # non-reentrant: works with inputs that need no grad and with autocast
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, ctx, use_reentrant=False)
            else:
                x = layer(x, cos, sin, ctx)
        hidden = self.model.norm(x)  # (B,T,C): post-norm, the EAGLE feature
        picked = (
            hidden
            if logit_index is None
            else hidden.gather(1, logit_index[..., None].expand(-1, -1, hidden.shape[-1]))
        )
        return self.lm_head(picked), hidden  # (B,T|K,V), (B,T,C)


# ---------------------------------------------------------------------------------------------
# Hugging Face checkpoints
# ---------------------------------------------------------------------------------------------


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


def load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a truncated or garbage file, or one holding NaN or
    inf, is one CheckpointError naming it (not a SafetensorError traceback, not a silent run)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(file)
    except (SafetensorError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({reason}); truncated or corrupted?"
        ) from None
    for name, tensor in tensors.items():
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{file}: tensor {name!r} holds NaN or inf values; corrupted?")
    return tensors


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in the index file."""
    root = Path(model_dir)
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        return load_safetensors(single)
    if not index.is_file():
        raise CheckpointError(
            f"{root}: neither model.safetensors nor model.safetensors.index.json found"
        )
    try:
        weight_map = read_json(index, "safetensors index", CheckpointError)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index}: expected JSON with a 'weight_map' field") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not isinstance(shard, str) or not (root / shard).is_file():
            raise CheckpointError(f"{index}: shard {shard!r} listed but missing")
        tensors.update(load_safetensors(root / shard))
    return tensors


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors header, reading no weights; a missing,
    truncated or garbage file is one CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118
    except (SafetensorError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({reason}); truncated or corrupted?"
        ) from None


def check_checkpoint(model_dir: str | Path) -> ModelConfig:
    """Validate a model directory without loading its weights: config.json, and every
    safetensors file's header (a truncated or garbage file fails here) with the tensors' names
    and shapes against the config. ``tltrun train`` runs it before starting its workers, so a
    damaged checkpoint is one error line, not a traceback per worker."""
    root = Path(model_dir)
    cfg = read_config(root)
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif index.is_file():
        weight_map = read_json(index, "safetensors index", CheckpointError)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' field")
        files = [root / str(s) for s in sorted(set(map(str, weight_map["weight_map"].values())))]
    else:
        raise CheckpointError(
            f"{root}: neither model.safetensors nor model.safetensors.index.json found"
        )
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        found.update(safetensors_shapes(file))
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    for name, want in shapes.items():
        if name not in found:
            raise CheckpointError(f"{root}: missing tensor {name!r}")
        if found[name] != want:
            raise CheckpointError(
                f"{root}: tensor {name!r} has shape {found[name]}, config implies {want}"
            )
    return cfg


def load_hf(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    try:
        check_device(device)
    except ValueError as err:
        raise UsageError(str(err)) from None
    cfg = read_config(model_dir)
    tensors = read_safetensors(model_dir)
    # Shapes from a model on the meta device (no memory): a config whose sizes do not match
    # the weights (e.g. a corrupted vocab_size of 10^21) is reported, never allocated.
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store a duplicate
    expected = set(shapes) - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    missing = sorted(expected - set(tensors))
    if missing:
        raise CheckpointError(
            f"{model_dir}: missing tensor {missing[0]!r} ({len(missing)} missing in all)"
        )
    for name in expected:
        want = shapes[name]
        if tuple(tensors[name].shape) != want:
            raise CheckpointError(
                f"{model_dir}: tensor {name!r} has shape {tuple(tensors[name].shape)}, config implies {want}"
            )
    model = Transformer(cfg)
    model.load_state_dict(tensors, strict=False)  # unknown extras (e.g. rotary buffers) ignored
    return model.to(device=device, dtype=dtype).eval()


def save_hf(
    model: Transformer, model_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """Write ``config.json`` + ``model.safetensors`` (tied LM head stored once, as HF does).
    ``state_dict``: the full weights when the model's own are sharded (FSDP2)."""
    from safetensors.torch import save_file

    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    weights = model.state_dict() if state_dict is None else state_dict
    state = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_file(state, root / "model.safetensors", metadata={"format": "pt"})

"""Synthetic long-tail reasoning-RL traces: ``GenConfig`` and ``generate(cfg) -> Trace``.

Run ``tltsim gen --out traces/x.json [--num-steps 8 --prompts-per-step 64 ...]`` (flags map 1:1
onto ``GenConfig``), or ``generate(GenConfig(seed=1))`` from Python.

The model (all in log-length space, one RL step ``s``, prompt ``j``, sample ``k`` of its group):

    z_j   ~ N(0, 1)                                   prompt difficulty, in standard deviations
    e_jk  ~ N(0, 1)                                   the sample's own luck
    x_jk  = difficulty_sigma * z_j + group_sigma * exp(group_sigma_growth * z_j) * e_jk
    len   = clip(round(median_response_tokens * exp(drift_per_step * s + x_jk)), 1, max_response_tokens)

so a group's samples scatter around their prompt's difficulty (RL groups are correlated), harder
prompts scatter more (the worst groups span 5-20x while the median group spans 2x), every length
is capped, and responses at the cap get ``finish: "length"``. Prompt lengths are lognormal and
independent of difficulty. ``latent_scores`` is shared with ``tltsim.trace.importers``, which keeps
only the ranks of these scores and maps them onto measured lengths.

Defaults come from the facts in /work/shared/traces/README.md (cited where each is set); the
three group parameters were fitted once to those facts, and tests/test_synth.py checks that the
defaults still reproduce them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from tltsim.trace.schema import MAX_COUNT, Trace, trace_from_arrays

# Group model, fitted to the published facts on reasoning-RL steps quoted in
# /work/shared/traces/README.md: a step's longest response is 10-25x its median; a prompt's 8
# samples differ by 2x at the median prompt and 5-20x at the worst. With 64 prompts x 8 these
# values give (median over seeds) step max/median ~17x, median-prompt spread ~2.0x, worst-group
# spread ~8x (10th-90th percentile 5-19x); tests/test_synth.py re-checks this.
# Most responses one generated trace may hold (steps x prompts x group size): the generator
# keeps float64 arrays of all of them, 10^7 responses is ~0.5 GB of JSON; 10^9 ran out of memory.
MAX_GEN_RESPONSES = 10_000_000
DIFFICULTY_SIGMA = 0.8
GROUP_SIGMA = 0.25
GROUP_SIGMA_GROWTH = 0.4


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class GenConfig:
    """Synthetic trace generator settings (one CLI flag per field: ``--num-steps`` ...)."""

    num_steps: int = field(default=8, metadata=_help("RL steps to generate"))
    prompts_per_step: int = field(default=64, metadata=_help("prompts per step"))
    # 8 samples per prompt: the group size of the RL traces the shared README's facts describe.
    group_size: int = field(default=8, metadata=_help("responses (samples) per prompt"))
    # 32,768: the output cap of DeepSeek-R1 serving in ServeGen (its maximum; requests pile up there).
    max_response_tokens: int = field(
        default=32768, metadata=_help("response cap; responses reaching it finish with 'length'")
    )
    # 640: median output tokens of DeepSeek-R1 in ServeGen (shared README), the one reasoning-model
    # length measurement shipped with the project.
    median_response_tokens: float = field(
        default=640.0, metadata=_help("median response length of the median prompt at step 0")
    )
    difficulty_sigma: float = field(
        default=DIFFICULTY_SIGMA, metadata=_help("log-length std. dev. across prompts")
    )
    group_sigma: float = field(
        default=GROUP_SIGMA,
        metadata=_help("log-length std. dev. within a group, at the median prompt"),
    )
    group_sigma_growth: float = field(
        default=GROUP_SIGMA_GROWTH,
        metadata=_help(
            "within-group std. dev. grows by exp(growth * z) for a prompt z std. devs. harder"
        ),
    )
    # ~3e-4 per step: DeepSeek-R1-Zero's mean response length grew roughly tenfold over ~8,000 RL
    # steps (DeepSeek-AI, arXiv 2501.12948, Fig. 3): ln(10) / 8000 = 2.9e-4.
    drift_per_step: float = field(
        default=3e-4,
        metadata=_help("log-length growth per step (RL responses lengthen during training)"),
    )
    # Prompt lengths: Azure 2023 conversation trace ContextTokens, median 1,020 and log std. dev.
    # 0.99 (computed from /work/shared/traces/azure_llm_inference_2023_conv.csv).
    median_prompt_tokens: float = field(default=1020.0, metadata=_help("median prompt length"))
    prompt_tokens_sigma: float = field(
        default=0.99, metadata=_help("log std. dev. of prompt length")
    )
    seed: int = field(default=0, metadata=_help("random seed (same seed, same trace, same bytes)"))
    # Informational only (trace meta): tltsim replay takes its cost model from its own flags.
    model: str = field(
        default="Qwen2.5-7B", metadata=_help("model name recorded in the trace meta")
    )

    def __post_init__(self) -> None:
        check_shape(self, ("num_steps", "prompts_per_step", "group_size", "max_response_tokens"))
        for name in ("median_response_tokens", "median_prompt_tokens"):
            if not 1 <= getattr(self, name) <= MAX_COUNT:
                raise ValueError(f"{name} must be in [1, {MAX_COUNT}], got {getattr(self, name)!r}")
        for name in ("difficulty_sigma", "group_sigma", "prompt_tokens_sigma"):
            if not 0 <= getattr(self, name) < 10:
                raise ValueError(f"{name} must be in [0, 10), got {getattr(self, name)!r}")
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2^63 - 1], got {self.seed!r}")
        for name in ("group_sigma_growth", "drift_per_step"):
            if not abs(getattr(self, name)) < 10:
                raise ValueError(
                    f"{name} must be finite and in (-10, 10), got {getattr(self, name)!r}"
                )


def check_shape(config: Any, counts: tuple[str, ...]) -> None:
    """A generated or imported trace's shape: each of ``counts`` (fields of ``config``) an
    integer in [1, MAX_COUNT], and at most MAX_GEN_RESPONSES responses in all (the generator and
    the importer hold them in memory)."""
    for name in counts:
        value = getattr(config, name)
        if type(value) is not int or not 1 <= value <= MAX_COUNT:
            raise ValueError(f"{name} must be an integer in [1, {MAX_COUNT}], got {value!r}")
    num_responses = config.num_steps * config.prompts_per_step * config.group_size
    if num_responses > MAX_GEN_RESPONSES:
        raise ValueError(
            f"num_steps x prompts_per_step x group_size = {num_responses} responses: at most "
            f"{MAX_GEN_RESPONSES} (they are all held in memory)"
        )


def latent_scores(
    rng: np.random.Generator,
    shape: tuple[int, ...],
    group_size: int,
    difficulty_sigma: float = DIFFICULTY_SIGMA,
    group_sigma: float = GROUP_SIGMA,
    group_sigma_growth: float = GROUP_SIGMA_GROWTH,
) -> np.ndarray:
    """Log-length offsets ``x`` of shape ``shape + (group_size,)`` (see the module docstring).

    ``shape`` is the prompt layout, e.g. ``(num_steps, prompts_per_step)``. Draw order is fixed
    (all difficulties, then all samples), so a seed always gives the same scores."""
    difficulty = rng.standard_normal(shape)[..., None]  # (..., 1)
    luck = rng.standard_normal((*shape, group_size))  # (..., G)
    return (
        difficulty_sigma * difficulty + group_sigma * np.exp(group_sigma_growth * difficulty) * luck
    )


def lognormal_ints(
    rng: np.random.Generator, shape: tuple[int, ...], median: float, sigma: float, cap: int
) -> np.ndarray:
    """Integers ``clip(round(median * exp(sigma * N(0,1))), 1, cap)`` (int64)."""
    log_value = np.log(median) + sigma * rng.standard_normal(shape)
    return np.clip(np.rint(np.exp(np.minimum(log_value, np.log(cap) + 1.0))), 1, cap).astype(
        np.int64
    )


def generate_arrays(cfg: GenConfig) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths (steps, prompts, group), prompt_tokens (steps, prompts))`` as int64 arrays."""
    rng = np.random.default_rng(cfg.seed)
    shape = (cfg.num_steps, cfg.prompts_per_step)
    x = latent_scores(
        rng, shape, cfg.group_size, cfg.difficulty_sigma, cfg.group_sigma, cfg.group_sigma_growth
    )
    drift = cfg.drift_per_step * np.arange(cfg.num_steps)[:, None, None]  # (S, 1, 1)
    log_len = np.log(cfg.median_response_tokens) + drift + x
    cap = cfg.max_response_tokens
    # Clamp before exp so huge settings cannot overflow; anything above the cap becomes the cap.
    lengths = np.clip(np.rint(np.exp(np.minimum(log_len, np.log(cap) + 1.0))), 1, cap).astype(
        np.int64
    )
    prompt_tokens = lognormal_ints(
        rng, shape, cfg.median_prompt_tokens, cfg.prompt_tokens_sigma, 2**31 - 1
    )
    return lengths, prompt_tokens


def generate(cfg: GenConfig) -> Trace:
    """A synthetic long-tail trace; the resolved config is recorded in ``meta["generator"]``."""
    lengths, prompt_tokens = generate_arrays(cfg)
    meta = {
        "source": "synthetic: tltsim gen (tltsim.synth, lognormal difficulty + correlated groups)",
        "model": cfg.model,
        "max_response_tokens": cfg.max_response_tokens,
        "group_size": cfg.group_size,
        "generator": asdict(cfg),
    }
    return trace_from_arrays(lengths, prompt_tokens, meta)

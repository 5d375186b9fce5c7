"""``SimConfig``: one simulation's cluster and model settings, one ``tltsim replay`` flag per field
(``tltsim.cli.replay`` builds the parser from the fields' ``help`` metadata), with the defaults'
sources cited where they are set and every value checked when the config is built.

    cfg = SimConfig(num_gpus=64, tp=1, tail_threshold=32)   # tltsim.sim.simulator.simulate
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

PLACEMENTS = ("round_robin", "chunked", "random")


def _help(text: str) -> dict[str, str]:
    return {"help": text}


# Most engine instances (num_gpus / tp) one simulation may model (SimConfig.__post_init__).
MAX_NUM_INSTANCES = 4096
# Seeds reach numpy and the policies as C int64 (a larger one overflowed inside a run).
MAX_SEED = 2**63 - 1
# Most simulations one command may ask for (a sweep's points x seeds, a replay's seeds): at ~1 s
# per simulation on one core, 100,000 is a day of a 32-core machine; more is a typo
# (num_points = 1e9 hung building points).
MAX_SIMULATIONS = 100_000


@dataclass(frozen=True)
class SimConfig:
    """One simulation's cluster and model settings (one ``tltsim replay`` flag per field).

    ``model`` / ``hardware`` name the presets the CLI builds the cost model from;
    ``simulate()`` itself uses the cost model object it is handed.
    """

    model: str = field(
        default="Qwen2.5-7B",
        metadata=_help(
            "target model: a preset (tltsim.cost.specs) or a Hugging Face config.json or model "
            "directory"
        ),
    )
    hardware: str = field(default="H100-SXM", metadata=_help("GPU preset (tltsim.cost.specs)"))
    num_gpus: int = field(default=8, metadata=_help("GPUs in the cluster"))
    tp: int = field(default=1, metadata=_help("tensor-parallel degree of one engine instance"))
    # 1024: veRL's rollout max_num_seqs default (fastrl_trainer.yaml, actor_rollout_ref.rollout).
    max_running_requests: int = field(
        default=1024, metadata=_help("continuous-batching cap per instance")
    )
    placement: str = field(
        default="round_robin",
        metadata={"help": "how requests are spread over instances", "choices": PLACEMENTS},
    )
    # 32: TLT's threshold for the long tail (arXiv 2511.16665, adaptive SD default).
    tail_threshold: int = field(
        default=32, metadata=_help("an instance with fewer active requests is in the tail")
    )
    # Spot trainer start-up, physics only: copy the drafter's training state host->device. The
    # Qwen2.5-7B drafter has 259M trainable parameters (tltsim.cost.specs.DrafterSpec); with bf16
    # weights and grads, fp32 master weights and Adam moments that is 16 B/param = 4.1 GB, over
    # PCIe Gen5 x16 (64 GB/s per direction, ~80% achievable: 51 GB/s) = 0.08 s, rounded to 0.1 s.
    # It grows with the drafter (70B target: 15.8 GB, 0.3 s). Whatever else a real trainer does
    # at start-up is not in it: measure a run with tltrun and set this field.
    spot_startup_s: float = field(
        default=0.1, metadata=_help("seconds before an idle instance starts training the drafter")
    )
    # Checkpoint when the rollout ends: the same 4.1 GB device->host, 0.08 s, rounded to 0.1 s.
    spot_checkpoint_s: float = field(
        default=0.1,
        metadata=_help("seconds a spot trainer needs to save the drafter when the rollout ends"),
    )
    # fastrl's drafter trainer (verl/trainer/config/fastrl_trainer.yaml, speculative.train):
    # batch_size_per_gpu 2 x max_seq_len 8192 tokens per GPU per update.
    drafter_update_tokens: int = field(
        default=16384, metadata=_help("tokens one drafter update consumes per GPU")
    )
    # vLLM V1 caches prompt blocks by default (automatic prefix caching) and tltrun's torch
    # engine shares identical prompts (EngineConfig.share_prompts): the responses of one GRPO
    # group prefill their prompt once (tltsim.sim.instance explains the cost).
    share_prompts: bool = field(
        default=True,
        metadata=_help("responses of one prompt (a group) share its prefill on an instance"),
    )
    # What a sharer reuses: whole blocks of this many prompt tokens, never the last token (vLLM
    # caches full KV blocks: 16 tokens on GPUs, 128 on CPU (vllm/platforms/cpu.py); 1 is token
    # granularity, as tltrun's torch engine and SGLang's radix cache at its default page size).
    prefix_block_tokens: int = field(
        default=1, metadata=_help("granularity in tokens of a shared prompt prefix")
    )
    exact: bool = field(
        default=False, metadata=_help("one SimPy event per decode iteration (slow reference)")
    )
    is_timeline_recorded: bool = field(
        default=True, metadata=_help("keep per-instance timeline segments")
    )
    seed: int = field(
        default=0, metadata=_help("seed of accept-length sampling and random placement")
    )

    def __post_init__(self) -> None:
        for name in (
            "num_gpus",
            "tp",
            "max_running_requests",
            "tail_threshold",
            "drafter_update_tokens",
            "prefix_block_tokens",
        ):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_gpus % self.tp:
            raise ValueError(f"num_gpus={self.num_gpus} is not a multiple of tp={self.tp}")
        # The spot-trainer accounting (instance_idle) is quadratic in instances: 4096 instances
        # take about a minute per simulated step on one core, 10^8 would never finish. 4096 is
        # 64x the largest preset, beyond the rollout clusters of published RL systems.
        if self.num_instances > MAX_NUM_INSTANCES:
            raise ValueError(
                f"num_gpus / tp = {self.num_instances} instances: at most {MAX_NUM_INSTANCES} "
                "are supported (the simulation's cost grows with the square of the instances)"
            )
        if self.placement not in PLACEMENTS:
            raise ValueError(
                f"placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}"
            )
        for name in ("spot_startup_s", "spot_checkpoint_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(
                    f"{name} must be a finite number >= 0, got {getattr(self, name)!r}"
                )
        if type(self.seed) is not int or not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"seed must be an integer in [0, 2^63 - 1], got {self.seed!r}")

    @property
    def num_instances(self) -> int:
        return self.num_gpus // self.tp

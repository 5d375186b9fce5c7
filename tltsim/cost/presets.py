"""Named clusters for ``tltsim replay --preset NAME`` and sweeps: model x GPU x count x TP.

    tltsim replay traces/synth.json --preset h100x64-qwen7b
    python -c "from tltsim.cost.presets import CLUSTER_PRESETS; print(list(CLUSTER_PRESETS))"

A preset only fills ``SimConfig``'s cluster fields (model, hardware, num_gpus, tp); explicit
flags override them. The model and GPU names are ``tltsim.cost.specs`` presets. The shapes follow the
TLT evaluation (arXiv 2511.16665, Sec. 7: Qwen2.5-7B, Qwen2.5-32B and Llama-3.3-70B class
targets on 8-GPU H100 / H200 nodes, up to 8 nodes) and fit the weights in GPU memory with the
TP degree given (bf16 weights: 7B 15 GB, 32B 65 GB, 70B 141 GB).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass


@dataclass(frozen=True)
class ClusterPreset:
    model: str
    hardware: str
    num_gpus: int
    tp: int

    def __post_init__(self) -> None:
        if self.num_gpus < 1 or self.tp < 1 or self.num_gpus % self.tp:
            raise ValueError(
                f"ClusterPreset: num_gpus={self.num_gpus} must be a positive multiple of tp={self.tp}"
            )


CLUSTER_PRESETS: dict[str, ClusterPreset] = {
    # 7B fits one GPU: TP 1, one engine per GPU (veRL's usual rollout layout for 7B).
    "h100x8-qwen7b": ClusterPreset("Qwen2.5-7B", "H100-SXM", 8, 1),
    "h100x64-qwen7b": ClusterPreset("Qwen2.5-7B", "H100-SXM", 64, 1),
    "h200x8-qwen7b": ClusterPreset("Qwen2.5-7B", "H200", 8, 1),
    "a100x8-qwen7b": ClusterPreset("Qwen2.5-7B", "A100-80GB", 8, 1),
    "h20x8-qwen7b": ClusterPreset("Qwen2.5-7B", "H20", 8, 1),
    "l40sx8-qwen7b": ClusterPreset("Qwen2.5-7B", "L40S", 8, 1),
    # 32B: 65 GB of weights; TP 2 leaves room for the KV cache on 80 GB parts, TP 1 would not.
    "h100x32-qwen32b": ClusterPreset("Qwen2.5-32B", "H100-SXM", 32, 2),
    "h200x8-qwen32b": ClusterPreset("Qwen2.5-32B", "H200", 8, 2),
    # 70B: 141 GB of weights; TP 4 on 80 GB parts (35 GB per GPU), TP 2 on H200 would leave
    # almost nothing for KV, so TP 4 there too.
    "h100x64-llama70b": ClusterPreset("Llama-3.1-70B", "H100-SXM", 64, 4),
    "h200x32-llama70b": ClusterPreset("Llama-3.1-70B", "H200", 32, 4),
}


def get_preset(name: str) -> ClusterPreset:
    if name not in CLUSTER_PRESETS:
        raise ValueError(
            f"unknown cluster preset {name!r}; expected one of {', '.join(CLUSTER_PRESETS)}"
        )
    return CLUSTER_PRESETS[name]


def apply_preset(config, name: str):
    """``config`` (a SimConfig) with its cluster fields taken from preset ``name``."""
    return dataclasses.replace(config, **dataclasses.asdict(get_preset(name)))

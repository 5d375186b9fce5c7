"""Write a random-weight target of a Qwen2.5 preset shape (``tltsim.cost.specs.MODEL_PRESETS``)
in the Hugging Face layout and a fresh EAGLE drafter for it in the layout ``tltrun`` exports, so
that ``tltrun profile --device cuda`` can time a GPU at a real model's shape with no download
(``benchmarks/gpu_session.sh``). A step's cost does not depend on the weights' values.

    python benchmarks/random_checkpoint.py --shape Qwen2.5-1.5B --out /tmp/ckpt
    # -> /tmp/ckpt/target (config.json + model.safetensors), /tmp/ckpt/drafter

``--shape tiny`` writes bench_gpu_engine's smoke shape (a check of the script on a CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.hf_checkpoint import save_hf
from tltsim.cost.specs import MODEL_PRESETS

sys.path.insert(0, str(Path(__file__).resolve().parent))  # benchmarks/ is not a package
from gpu_engine_models import build_model  # noqa: E402

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def write_random_checkpoint(
    shape: str, out: Path, device: torch.device, dtype: torch.dtype, seed: int
) -> tuple[Path, Path]:
    """``out/target`` and ``out/drafter``; the weights are made on ``device`` (fast on a GPU)."""
    target = build_model(shape, device, dtype, seed)
    save_hf(target, out / "target")
    drafter = EagleDrafter.for_target(target, seed=seed + 1)
    export_vllm(drafter, out / "drafter", meta={"note": f"random weights, {shape} shape"})
    return out / "target", out / "drafter"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", required=True, choices=("tiny", *MODEL_PRESETS), help="model shape")
    p.add_argument("--out", required=True, help="directory to write target/ and drafter/ into")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=tuple(DTYPES))
    p.add_argument("--seed", type=int, default=0, help="seed of the random weights")
    a = p.parse_args(argv)
    target, drafter = write_random_checkpoint(
        a.shape, Path(a.out), torch.device(a.device), DTYPES[a.dtype], a.seed
    )
    print(f"wrote {target} and {drafter}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

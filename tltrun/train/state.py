"""Checkpoints and logs of ``tltrun train`` (tltrun.train.launch): atomic checkpoint directories, the
per-step JSONL logs and the measured tlt-trace rebuilt from them, and the resume bookkeeping.

Checkpoint ``OUT/ckpt/step_NNNNNN`` (NNNNNN = completed steps = the next step to run):

* ``actor/``: Hugging Face layout (tltrun.model.transformer.save_hf + tokenizer files), loadable as a model;
* ``actor_optim.pt``: AdamW state; ``drafter/`` (vLLM EAGLE layout) + ``drafter_optim.pt``
  (AdamW state and drafter version): identical on every worker after the end-of-step sync;
* ``rank{r}.pt``: worker r's RNG states (python, numpy, torch, engine sampler, spot-trainer
  data and noise generators) and its previous step's harvest (spot training uses it in the
  next step);
* ``policy_rank{r}.json``: worker r's ``SpecPolicy.state_dict()`` (TLTAdaptive's bandit learns),
  plain JSON, restored into the policy the run's config rebuilds (no pickled object: it
  survives a module move);
* ``state.json``: ``{"next_step": N}``, written last.

Atomicity: everything is written into ``ckpt/.tmp_step_NNNNNN`` and renamed in one
``os.rename`` by rank 0 after all ranks wrote their files (barriers). A kill at any moment
leaves either the previous checkpoints or the new complete one; leftover ``.tmp_*``
directories are deleted on resume. Log rows of steps at or after the resumed step (written by
the killed run after its last checkpoint) are dropped, so no step is lost or repeated.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

from tltsim.trace.files import save_trace
from tltsim.trace.schema import trace_from_dict

CKPT_RE = re.compile(r"^step_(\d{6})$")
LOGS = ("log.jsonl", "trace_steps.jsonl")


def checkpoint_dir(out: Path, next_step: int) -> Path:
    return out / "ckpt" / f"step_{next_step:06d}"


def tmp_checkpoint_dir(out: Path, next_step: int) -> Path:
    return out / "ckpt" / f".tmp_step_{next_step:06d}"


def latest_checkpoint(out: Path) -> Path | None:
    root = out / "ckpt"
    if not root.is_dir():
        return None
    for leftover in root.glob(".tmp_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    done = [p for p in root.iterdir() if CKPT_RE.match(p.name) and (p / "state.json").is_file()]
    return max(done, key=lambda p: p.name) if done else None


def read_next_step(ckpt: Path) -> int:
    return int(json.loads((ckpt / "state.json").read_text())["next_step"])


def truncate_logs(out: Path, start_step: int) -> None:
    """Keep only rows of steps < start_step (a fresh run: none)."""
    for name in LOGS:
        path = out / name
        if not path.is_file():
            continue
        rows = [line for line in path.read_text().splitlines() if line.strip()]
        kept = [line for line in rows if json.loads(line)["step"] < start_step]
        _write_atomic(path, "".join(line + "\n" for line in kept))


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_trace(out: Path, meta: dict[str, Any]) -> None:
    """trace.json from trace_steps.jsonl (each row one tlt-trace step dict)."""
    steps = read_jsonl(out / "trace_steps.jsonl")
    trace = trace_from_dict(
        {"format": "tlt-trace", "version": 1, "meta": meta, "steps": steps},
        str(out / "trace_steps.jsonl"),
    )
    save_trace(trace, out / "trace.tmp.json")
    os.replace(out / "trace.tmp.json", out / "trace.json")


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_policy_state(ckpt_dir: Path, rank: int, policy) -> None:
    """``policy.state_dict()`` as ``ckpt_dir/policy_rank{rank}.json`` (``write_state`` fsyncs it)."""
    (ckpt_dir / f"policy_rank{rank}.json").write_text(json.dumps(policy.state_dict()) + "\n")


def load_policy_state(ckpt_dir: Path, rank: int, policy) -> None:
    """Restore ``save_policy_state``'s file into ``policy`` (built from the run's config)."""
    path = ckpt_dir / f"policy_rank{rank}.json"
    if not path.is_file():
        from tltrun.model.transformer import CheckpointError

        raise CheckpointError(
            f"{path}: missing (a checkpoint written before policies were saved as state_dict(); start the run afresh)"
        )
    policy.load_state_dict(json.loads(path.read_text()))


def write_state(tmp_dir: Path, next_step: int) -> None:
    (tmp_dir / "state.json").write_text(json.dumps({"next_step": next_step}) + "\n")
    for path in tmp_dir.rglob("*"):
        if path.is_file():
            with path.open("rb") as f:
                os.fsync(f.fileno())


def commit(tmp_dir: Path, final_dir: Path) -> None:
    if final_dir.exists():
        shutil.rmtree(final_dir)
    os.rename(tmp_dir, final_dir)


def copy_tokenizer(model_dir: str | Path, dest: Path) -> None:
    for name in (
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "sft_config.json",
    ):
        src = Path(model_dir) / name
        if src.is_file():
            shutil.copyfile(src, dest / name)


def export_drafter_atomic(drafter, dest: Path) -> None:
    """export_vllm into a temporary directory, then swap it in by renames."""
    from tltrun.model.drafter import export_vllm

    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    shutil.rmtree(tmp, ignore_errors=True)
    export_vllm(drafter, tmp)
    if dest.exists():
        os.rename(dest, old)
    os.rename(tmp, dest)
    shutil.rmtree(old, ignore_errors=True)

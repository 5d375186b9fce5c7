"""The resumable state of the single-process offline trainings, ``tltrun sft`` (tltrun.train.sft)
and ``tltrun train-drafter`` (tltrun.train.drafter_training): ``--checkpoint-every N`` writes
``OUT/resume_state.pt`` every N steps and after the last one, and ``--resume`` continues a
killed run from it so that it ends bitwise as the uninterrupted run would have (same machine,
same torch thread count: float reductions depend on it).

The file (``torch.save``, read back with ``weights_only=True``: tensors and plain data only, no
pickled object): ``format``, ``version``, ``command``, ``next_step`` (the steps done), ``weights``
(the model's or drafter's ``state_dict``), ``optimizer`` (AdamW's ``state_dict``), ``log`` (the
per-step rows so far), ``data_sha256`` (a fingerprint of the training data: a resume refuses
data that changed; None for the built-in task, which the seed makes) and what the command needs
to continue its random streams (train-drafter: its two ``torch.Generator`` states; sft makes its
batch stream again from the seed and skips the ``next_step`` batches already trained on: one
batch per step, 1.7 s for the 4000 of a default run on this CPU) and its clock (sft:
``train_s``, the training seconds so far, so that metrics.json's covers the whole run).

Atomicity: written to ``resume_state.pt.tmp`` in the same directory, flushed, fsynced and
renamed over the previous state (``os.replace``, then the directory fsynced): a kill at any
moment leaves the previous state or the new one, never a torn file. A stray ``.tmp`` (a kill
mid-write) is never read and is overwritten by the next write.

Resume: the run's recorded config (``sft_config.json`` / ``train_config.json``, written when the
run started) is the source of every setting; flags given with ``--resume`` that differ from it
are refused with one line naming each field, except ``--out`` (the same directory however it
is spelt) and ``--checkpoint-every``, which do not change the result (``tltrun train
--resume`` without ``--override-config`` refuses the same way; there is no override here). A
fresh run into a directory that holds a state, or files that no run of its command wrote, is
refused (pass ``--resume`` or another ``--out``), and removes an earlier run's outputs first;
``--resume`` where there is none is an error, unless the run finished, which is one line and
exit 0 (a finished ``tltrun train --resume`` runs no step and exits 0 too).

When the run has written all its outputs the state is deleted: it holds the weights again plus
AdamW's two moments (3x the weights), and a finished run is not continued (more steps make a
new run: the learning-rate schedule depends on the step count).
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from tltrun.model.config import CheckpointError
from tltrun.train.state import config_diff, fsync_dir
from tltsim.errors import UsageError
from tltsim.jsonio import read_json, typed_fields

STATE_FILE = "resume_state.pt"
FORMAT = "tlt-offline-resume"
# settings a resume may change: they leave the trained weights and the log as they are
RESUME_NEUTRAL_FIELDS = ("out", "checkpoint_every")


@dataclass(frozen=True, kw_only=True)
class Checkpointing:
    """Where a training loop of ``command`` writes its resumable state, how often, and whether
    it starts from the one there."""

    out: Path
    command: str  # "tltrun sft": named in errors, and a state of another command is refused
    every: int  # steps between states; 0 writes none
    is_resume: bool = False

    def is_due(self, num_done: int, num_steps: int) -> bool:
        """After ``num_done`` steps: every ``every`` steps, and after the last one too, so a
        kill during the evaluation or export that follows training redoes no step."""
        return self.every > 0 and (num_done % self.every == 0 or num_done == num_steps)

    def save(
        self,
        next_step: int,
        module: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        log: list[dict[str, Any]],
        data_sha256: str | None,
        **extra: Any,
    ) -> None:
        """Write ``OUT/resume_state.pt`` atomically (the module docstring)."""
        state = {
            "format": FORMAT,
            "version": 1,
            "command": self.command,
            "next_step": next_step,
            "weights": module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "log": log,
            "data_sha256": data_sha256,
            **extra,
        }
        path = self.out / STATE_FILE
        tmp = path.with_name(path.name + ".tmp")
        try:
            with tmp.open("wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            tmp.unlink(missing_ok=True)  # the previous state stays; a partial copy is no use
            raise
        fsync_dir(self.out)  # the rename survives a power cut once synced

    def load(
        self, module: torch.nn.Module, optimizer: torch.optim.Optimizer, data_sha256: str | None
    ) -> dict[str, Any]:
        """Restore ``module`` and ``optimizer`` from ``OUT/resume_state.pt``; returns the
        state (``next_step``, ``log`` and the command's extras)."""
        path = self.out / STATE_FILE
        if not path.is_file():
            raise UsageError(f"{self.out}: no {STATE_FILE} to resume from")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except (RuntimeError, pickle.UnpicklingError, EOFError, ValueError) as err:
            first = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(f"{path}: not a readable resumable state ({first})") from None
        if not (
            isinstance(state, dict)
            and state.get("format") == FORMAT
            and state.get("command") == self.command
            and len(state.get("log", ())) == state.get("next_step")
        ):
            raise CheckpointError(f"{path}: not a resumable state of {self.command}")
        if state["data_sha256"] != data_sha256:
            raise UsageError(
                f"{self.out}: --resume with other training data than the run started on (its "
                "fingerprint differs); restore the data, or start a new run in another --out"
            )
        try:
            module.load_state_dict(state["weights"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as err:
            first = str(err).splitlines()[0]
            raise CheckpointError(f"{path}: does not fit the run's model ({first})") from None
        return state


def fingerprint(chunks: Iterable[bytes]) -> str:
    """sha256 of ``chunks``, each prefixed by its length (so ("ab", "c") != ("a", "bc"))."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(len(chunk).to_bytes(8, "little"))
        digest.update(chunk)
    return digest.hexdigest()


# What each offline command writes into --out besides its config file: a fresh run removes an
# earlier run's before it starts (a killed fresh run left the old model.safetensors beside the
# new config, and generate, train and sft-eval used it as this run's)
OUTPUTS = {
    "sft_config.json": (  # tltrun sft: an HF model directory and metrics.json
        "config.json", "generation_config.json", "model.safetensors", "metrics.json",
        "special_tokens_map.json", "tokenizer.json", "tokenizer_config.json",
    ),
    "train_config.json": (  # tltrun train-drafter: vLLM's EAGLE layout and history.json
        "config.json", "model.safetensors", "tlt_drafter.json", "history.json",
    ),
}  # fmt: skip


def start_fresh(out: Path, command: str, config_file: str) -> None:
    """Ready ``out`` for a fresh run of ``command`` (whose settings go to ``config_file``):
    refused over an unfinished run's state (the first checkpoint would overwrite it, and a
    later ``--resume`` would continue the wrong run) and over files that no earlier run of
    ``command`` wrote (a model directory of the user's: train-drafter --out of its --model
    replaced the target with the drafter); an earlier run's outputs go, so that this run, if
    killed, leaves neither the old model nor a finish file beside its own config."""
    outputs = OUTPUTS[config_file]
    if not (out / config_file).is_file():
        found = (
            sorted({*outputs, *OUTPUTS} & {p.name for p in out.iterdir()}) if out.is_dir() else []
        )
        if found:
            raise UsageError(
                f"{out}: holds {', '.join(found)} that no {command} run wrote (no "
                f"{config_file}): another run's or a model's directory; choose another --out"
            )
    if (out / STATE_FILE).is_file():
        raise UsageError(
            f"{out}: holds the resumable state of an unfinished {command} run ({STATE_FILE}); "
            "pass --resume to continue it, or choose another --out"
        )
    for name in outputs:
        (out / name).unlink(missing_ok=True)


# The section of config.json that names the tltrun command that wrote it
RUN_SECTIONS = {"generate": "tltrun generate", "bench": "tltrun bench", "train": "tltrun train"}


def written_by(out: Path) -> str | None:
    """What wrote ``out/config.json``: a tltrun command (its section), a tltsim command (its
    ``kind``), a model (a Hugging Face config's ``model_type``); None where there is none, or
    one none of these wrote."""
    try:
        config = json.loads((out / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(config, dict):
        return None
    if "model_type" in config:
        return "a model"
    if config.get("kind") in ("replay", "sweep", "compare"):
        return f"tltsim {config['kind']}"
    return next((command for key, command in RUN_SECTIONS.items() if key in config), None)


def refuse_other_results(out: Path, command: str) -> None:
    """A fresh run of ``command`` writes its config.json over the one in ``out``: refused where
    another command or a model wrote it (hunt: ``generate --out MODEL`` replaced the model's
    config.json; ``generate --out`` a train run's directory made it unresumable)."""
    other = written_by(out)
    if other is not None and other != command:
        what = "a model's config.json" if other == "a model" else f"the results of {other}"
        raise UsageError(
            f"--out {out}: holds {what}; give this {command} a directory of its own (or "
            "remove that one)"
        )


def check_resume_dir(out: Path, is_resume: bool) -> None:
    """``tltrun train``'s --out: --resume of a directory that does not exist: refused before it is made (a refusal left
    an empty --out holding run.lock); a fresh run over another command's results or a model
    (``refuse_other_results``)."""
    if is_resume and not out.is_dir():
        raise UsageError(f"{out}: --resume, but no run was started here (no such directory)")
    if not is_resume:  # (a resume reads config.json as a run's, and says it is not)
        refuse_other_results(out, "tltrun train")


def configs_to_resume(
    out: str | None, command: str, config_file: str, finished_file: str, sections: dict[str, type]
) -> dict[str, Any] | None:
    """``--resume``'s start: the run's recorded configs (``recorded_configs`` of
    ``out/config_file``) when ``out`` holds a state to resume, None when the run finished (the
    caller says so and stops); neither is a UsageError."""
    if not out:
        raise UsageError("--resume needs --out, the directory of the run to continue")
    if not (Path(out) / STATE_FILE).is_file():
        if (Path(out) / finished_file).is_file():
            return None
        raise UsageError(
            f"{out}: no {STATE_FILE} to resume from (not a {command} run, one with "
            "--checkpoint-every 0, or one stopped before its first state); start it again "
            "without --resume"
        )
    return recorded_configs(Path(out) / config_file, sections)


def finish(out: Path) -> None:
    """The run wrote all its outputs: its state goes (the module docstring says why)."""
    (out / STATE_FILE).unlink(missing_ok=True)


def recorded_configs(config_path: Path, sections: dict[str, type]) -> dict[str, Any]:
    """The config dataclasses a run recorded in ``config_path`` (section name -> class), each
    value checked against its field's type (``typed_fields``)."""
    raw = read_json(config_path, "recorded run config")
    try:
        return {
            name: cls(**typed_fields(cls, raw[name], f"{config_path} [{name}]"))
            for name, cls in sections.items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as err:  # not what the run wrote
        raise UsageError(
            f"{config_path}: not a run config with sections {', '.join(sections)} "
            f"({type(err).__name__}: {err})"
        ) from None


def refuse_changes(config_path: Path, recorded: dict[str, Any], given: dict[str, Any]) -> None:
    """A resume runs with the recorded settings: ``given`` (the recorded configs with the
    flags of the ``--resume`` command line applied) may differ from ``recorded`` only in
    ``RESUME_NEUTRAL_FIELDS``; else one UsageError names every changed field."""
    changes = [
        f"{name}.{field}: {old!r} -> {new!r}"
        for name in recorded
        for field, (old, new) in config_diff(asdict(recorded[name]), asdict(given[name])).items()
        if field not in RESUME_NEUTRAL_FIELDS
    ]
    if changes:
        raise UsageError(
            f"{config_path.parent}: --resume with settings that differ from the run's "
            f"{config_path.name} ({'; '.join(changes)}); resume without those flags, or start a "
            "new run in another --out"
        )

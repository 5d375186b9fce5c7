"""Checkpoints of ``tltrun train`` (tltrun.train.launch): atomic checkpoint directories and the
resume bookkeeping (the per-step JSONL logs and the measured trace: tltrun.train.run_logs).

Checkpoint ``OUT/ckpt/step_NNNNNN`` (NNNNNN = completed steps = the next step to run):

* ``actor/``: Hugging Face layout (tltrun.model.hf_checkpoint.save_hf + tokenizer files), loadable as a model;
* ``dcp/``: actor weights + AdamW state, ``drafter_dcp/``: the spot trainer's drafter, AdamW
  state and version, both torch.distributed.checkpoint directories (tltrun.train.checkpoint:
  any world size loads them; the drafter's is written asynchronously during the next rollout);
  ``drafter/``: the drafter in vLLM's EAGLE layout (identical on every worker after the
  end-of-step sync);
* ``rank{r}.pt``: worker r's RNG states (python, numpy, torch, engine sampler, spot-trainer
  data and noise generators) and its previous step's harvest (spot training uses it in the
  next step);
* ``policy_rank{r}.json``: worker r's ``SpecPolicy.state_dict()`` (TLTAdaptive's bandit learns),
  plain JSON, restored into the policy the run's config rebuilds (no pickled object: it
  survives a module move);
* ``state.json``: ``{"next_step": N, "num_workers": W, "data_position": ...}`` (W: the world
  size that wrote the per-rank files; a resume on more ranks starts the others fresh);
* ``manifest.json``: sha256 and size of every other file, written last (temporary name, fsync,
  ``os.replace``).

Atomicity: everything is written into ``ckpt/.tmp_step_NNNNNN`` and renamed in one
``os.rename`` by rank 0 after all ranks wrote their files, the asynchronous drafter write
included (barriers); the renamed directory is the "latest" marker. A kill at any moment
leaves either the previous checkpoints or the new complete one; leftover ``.tmp_*``
directories are deleted on resume.

Resume (``select_checkpoint``, ``run_logs.prepare_logs``): the newest checkpoint whose files all match
its manifest is used; newer damaged ones (a flipped byte, a truncated or missing file, a
missing or garbled manifest) are skipped with a ``RunDirWarning`` naming each file and how it
differs, and none intact is a ``CheckpointError`` saying the same. Log rows of steps at or after
the resumed step (written after that checkpoint, or by steps it redoes) are dropped, so no step
is lost or repeated; a torn last line (a kill mid-append) is dropped with a warning, and a log
that stops before the checkpoint's step is an error. ``RunLock`` keeps a second launcher out of
a running run's directory; ``config_diff`` and ``config_history.jsonl`` keep a resumed run's
settings those of its first run unless the user overrides them (tltrun.train.launch).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tltsim.errors import TLTError, UsageError

CKPT_RE = re.compile(r"^step_(\d{6})$")
LOGS = ("log.jsonl", "trace_steps.jsonl")
MANIFEST = "manifest.json"
MANIFEST_FORMAT = "tlt-checkpoint-manifest"
CONFIG_HISTORY = "config_history.jsonl"
LOCK = "run.lock"


class RunDirWarning(UserWarning):
    """Resume skipped a damaged checkpoint or dropped a torn log line (one line; the CLI prints
    it as ``warning: ...``)."""


def checkpoint_error(message: str) -> TLTError:
    # CheckpointError lives beside the model loader, which imports torch; state.py's manifest
    # and log checks stay importable (and unit-testable) without it.
    from tltrun.model.config import CheckpointError

    return CheckpointError(message)


def checkpoint_dir(out: Path, next_step: int) -> Path:
    return out / "ckpt" / f"step_{next_step:06d}"


def tmp_checkpoint_dir(out: Path, next_step: int) -> Path:
    return out / "ckpt" / f".tmp_step_{next_step:06d}"


def read_next_step(ckpt: Path) -> int:
    return int(json.loads((ckpt / "state.json").read_text())["next_step"])


# What a run writes in its directory besides config.json, final/ and the lock: a fresh run
# removes an earlier, killed run's (one whose directory holds no checkpoint, or launch refuses)
RUN_FILES = (
    *LOGS,
    CONFIG_HISTORY,
    "reward_errors.log",
    "worker_errors.log",
    "trace.json",
    "trace.json.tmp",  # a kill mid-append (tltsim.trace.files.append_steps)
    "trace.tmp.json",  # a kill between run_logs.write_trace's save and rename
)
RUN_DIRS = ("rollouts", "tensorboard", "ckpt", "drafter", "drafter.tmp", "drafter.old")
RUN_DIRS += (".tmp_final", ".tmp_old_final")  # (final/ being replaced: tltrun.train.worker)
FINAL_STATE = "run_state.json"  # final/'s record of the steps trained ({"num_steps": N})


def final_steps(out: Path) -> int | None:
    """The steps the run's final/ holds (None: no final/, or one without the record: a run
    before 2026-11-29 wrote it in place, so it may be torn or of fewer steps)."""
    try:
        value = json.loads((out / "final" / FINAL_STATE).read_text())["num_steps"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return value if isinstance(value, int) else None


def reset_run_dir(out: Path, keep: Sequence[Path] = ()) -> None:
    """A fresh run in ``out``: no rows, config history, TensorBoard events, exported drafter or
    unfinished checkpoint (``ckpt/.tmp_step_*``) of an earlier run, which would otherwise be
    mixed into this run's (a leftover checkpoint directory was committed as this run's). A path
    that is, or holds, one of ``keep`` (the run's inputs: ``--drafter-dir OUT/drafter``) stays."""
    kept = [p.resolve() for p in keep]

    def is_input(path: Path) -> bool:
        where = path.resolve()
        return any(k == where or where in k.parents for k in kept)

    for name in RUN_FILES:
        if not is_input(out / name):
            (out / name).unlink(missing_ok=True)
    for name in RUN_DIRS:
        if not is_input(out / name):
            shutil.rmtree(out / name, ignore_errors=True)


# ---- the run's lock and settings ------------------------------------------------------------


class RunLock:
    """An advisory ``fcntl.flock`` on ``OUT/run.lock``, held by the launcher for the run's life
    (``with RunLock(out):``): a second launcher on the same directory gets a UsageError instead
    of interleaving logs and checkpoints. The kernel releases it when the holder dies, however
    it dies, so a killed run never leaves a stale lock behind. The file names the holder,
    ``<command> pid <pid>`` (``tltrun sft`` and ``tltrun train-drafter`` lock their --out too),
    and the refusal quotes it."""

    def __init__(self, out: Path, command: str = "tltrun train"):
        self.path = out / LOCK
        self.command = command
        self._file = None

    def __enter__(self) -> RunLock:
        f = self.path.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            holder = f.read().strip() or "another process"
            f.close()
            command = holder.rpartition(" pid ")[0] or "run"  # "pid N": a lock of older code
            raise UsageError(
                f"{self.path.parent}: another {command} is running in this directory "
                f"({holder} holds {self.path}); wait for it or use another --out"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{self.command} pid {os.getpid()}\n")
        f.flush()
        self._file = f
        return self

    def __exit__(self, *exc) -> None:
        if self._file is not None:
            # a run refused before it wrote anything leaves no directory holding only its lock
            # (the command then removes the --out it created, as for any refusal); unlinked
            # while still held, so no later process can lock the old file
            try:
                if [p.name for p in self.path.parent.iterdir()] == [LOCK]:
                    self.path.unlink()
            except OSError:
                pass
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None


def config_diff(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list]:
    """``{field: [old, new]}`` of the fields both have whose values differ (JSON values: a
    tuple and the list it was saved as are equal). A field only one has was added or removed
    by a code change since the run started, not by the user, so it is not a difference."""
    old, new = json.loads(json.dumps(old)), json.loads(json.dumps(new))
    return {k: [old[k], new[k]] for k in sorted(set(old) & set(new)) if old[k] != new[k]}


# Fields renamed since a run may have written them, by config.json section: a resume reads an
# older run's settings under the current names (a field only one side has is not compared,
# config_diff, so a renamed one would otherwise drop out of the resume's check)
RENAMED_FIELDS = {"train": {"fuse_qkv": "fuse_projections"}}  # when gate/up were stacked too


def effective_config(out: Path, before_step: int | None = None) -> dict[str, Any] | None:
    """The run's settings now: the first run's ``config.json`` with every override of
    ``config_history.jsonl`` applied in order (None: no config.json), fields renamed since
    (``RENAMED_FIELDS``) under their current names. Keys of the diffs are ``section.field``
    (``train.lr``). ``before_step``: the settings the steps before it ran with (the overrides
    of resumes that started earlier; a resume from step s records its changes at s). A file
    not as tltrun train wrote it is one CheckpointError naming the file (and the history's
    line) and what was expected."""
    path = out / "config.json"
    if not path.is_file():
        return None
    config = _json_file_value(path, path.read_bytes())
    if not isinstance(config, dict):
        raise _not_written(path, "an object with 'train' and 'task' objects", config)
    for section in SECTIONS:
        if not isinstance(config.get(section), dict):
            raise _not_written(path, f"a {section!r} object", config.get(section))
    history = out / CONFIG_HISTORY
    lines = history.read_bytes().splitlines() if history.is_file() else []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = Path(f"{history}, line {number}")
        row = _json_file_value(where, line)
        if not isinstance(row, dict):
            raise _not_written(where, 'an object with a "diff" object', row)
        diff = row.get("diff")
        if not isinstance(diff, dict):
            raise _not_written(where, 'a "diff" object', diff)
        if before_step is not None and not (
            isinstance(row.get("step"), int) and row["step"] < before_step
        ):
            continue
        for key, change in diff.items():
            section, _, name = key.partition(".")
            if section not in SECTIONS or not name:
                raise _not_written(where, "'train.<field>' or 'task.<field>' keys", key)
            if not (isinstance(change, list) and len(change) == 2):
                raise _not_written(where, f"[old, new] for {key}", change)
            config[section][name] = change[1]
    for section, renames in RENAMED_FIELDS.items():
        values = config[section]
        for old, new in renames.items():
            if old in values and new not in values:
                values[new] = values.pop(old)
    return config


SECTIONS = ("train", "task")  # config.json's settings (its "data" section records the inputs)


def _json_file_value(where: Path, raw: bytes) -> Any:
    try:
        return json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError) as err:
        raise checkpoint_error(f"{where}: not JSON as tltrun train writes it ({err})") from None


def _not_written(where: Path, expected: str, got: Any) -> TLTError:
    shown = type(got).__name__ if isinstance(got, (dict, list)) else repr(got)
    return checkpoint_error(
        f"{where}: not what tltrun train wrote (expected {expected}, got {shown})"
    )


def append_config_history(out: Path, step: int, time_utc: str, diff: dict[str, list]) -> None:
    """One row ``{"step", "time", "diff": {"section.field": [old, new]}}`` of a resume that
    overrode the run's settings (``config.json`` stays the first run's)."""
    append_jsonl(out / CONFIG_HISTORY, {"step": step, "time": time_utc, "diff": diff})


# ---- manifest -------------------------------------------------------------------------------


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def write_manifest(ckpt_dir: Path) -> None:
    """``manifest.json`` of every file under ``ckpt_dir`` (relative path -> sha256, size), after
    fsyncing each: written last, so a manifest that verifies means every file it names was on
    disk whole when it was written."""
    files = {}
    for path in sorted(p for p in ckpt_dir.rglob("*") if p.is_file() and p.name != MANIFEST):
        with path.open("rb") as f:
            os.fsync(f.fileno())
        rel = path.relative_to(ckpt_dir).as_posix()
        files[rel] = {"sha256": file_sha256(path), "size_bytes": path.stat().st_size}
    manifest = {"format": MANIFEST_FORMAT, "version": 1, "files": files}
    tmp = ckpt_dir / (MANIFEST + ".tmp")
    with tmp.open("w") as f:
        f.write(json.dumps(manifest, indent=1) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, ckpt_dir / MANIFEST)
    fsync_dir(ckpt_dir)


def _read_manifest(ckpt_dir: Path) -> tuple[dict[str, dict] | None, str]:
    """(files, "") or (None, what is wrong with the manifest)."""
    path = ckpt_dir / MANIFEST
    if not path.is_file():
        return None, f"{MANIFEST}: missing"
    try:
        manifest = json.loads(path.read_bytes().decode())
    except (UnicodeDecodeError, ValueError) as err:
        return None, f"{MANIFEST}: not valid JSON ({err})"
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != MANIFEST_FORMAT
        or not isinstance(files, dict)
        or not all(
            isinstance(e, dict)
            and isinstance(e.get("sha256"), str)
            and type(e.get("size_bytes")) is int
            for e in files.values()
        )
    ):
        return (
            None,
            f"{MANIFEST}: not a {MANIFEST_FORMAT} (format, files: {{path: sha256, size_bytes}})",
        )
    return files, ""


def looks_intact(ckpt_dir: Path) -> bool:
    """``verify_checkpoint`` unhashed (for a message): the manifest's files there, sized."""
    files, _ = _read_manifest(ckpt_dir)
    sizes = {rel: entry["size_bytes"] for rel, entry in (files or {}).items()}
    return files is not None and all(
        (ckpt_dir / r).is_file() and (ckpt_dir / r).stat().st_size == n for r, n in sizes.items()
    )


def verify_checkpoint(ckpt_dir: Path, num_workers: int) -> list[str]:
    """What is damaged in ``ckpt_dir`` (empty: intact), one ``FILE: how`` entry per file: the
    manifest missing or garbled, a file it names missing, of another size or another sha256,
    a file every checkpoint has missing from it, or ``state.json`` naming another step.
    ``num_workers``: the world size expected to have written per-rank files, unless
    ``state.json`` names the one that did."""
    files, problem = _read_manifest(ckpt_dir)
    if files is None:
        return [problem]
    # the world size that wrote the per-rank files (a resume may run on another); a bad
    # state.json is reported by the checks below
    with contextlib.suppress(OSError, UnicodeDecodeError, ValueError, KeyError, TypeError):
        num_workers = int(json.loads((ckpt_dir / "state.json").read_text())["num_workers"])
    required = ["state.json", "dcp/.metadata"]
    required += [f"rank{r}.pt" for r in range(num_workers)]
    required += [f"policy_rank{r}.json" for r in range(num_workers)]
    problems = [f"{name}: not in the manifest" for name in required if name not in files]
    for rel, entry in files.items():
        path = ckpt_dir / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
            continue
        size = path.stat().st_size
        if size != entry["size_bytes"]:
            how = "truncated" if size < entry["size_bytes"] else "grown"
            problems.append(f"{rel}: {size} bytes, manifest says {entry['size_bytes']} ({how})")
        elif file_sha256(path) != entry["sha256"]:
            problems.append(f"{rel}: sha256 differs from the manifest (same size: bytes changed)")
    if not problems:
        match = CKPT_RE.match(ckpt_dir.name)
        try:
            next_step = read_next_step(ckpt_dir)
        except (UnicodeDecodeError, ValueError, KeyError, TypeError) as err:
            return [f"state.json: no next_step ({err})"]
        if match and next_step != int(match.group(1)):
            problems.append(
                f"state.json: next_step {next_step}, the directory says {int(match.group(1))}"
            )
    return problems


def select_checkpoint(out: Path, num_workers: int) -> Path | None:
    """The newest intact checkpoint of run ``out`` (None: there is none at all). Damaged newer
    ones are skipped with a RunDirWarning each; if every checkpoint is damaged, CheckpointError
    names each one's damage. Leftover ``.tmp_*`` directories (a kill mid-write) are deleted."""
    root = out / "ckpt"
    if not root.is_dir():
        return None
    for leftover in root.glob(".tmp_*"):
        shutil.rmtree(leftover, ignore_errors=True)
    found = sorted((p for p in root.iterdir() if CKPT_RE.match(p.name)), reverse=True)
    damaged = []
    for ckpt in found:
        problems = verify_checkpoint(ckpt, num_workers)
        if not problems:
            for bad, its_problems in damaged:
                warnings.warn(
                    f"checkpoint {bad} is damaged ({'; '.join(its_problems)}); "
                    f"resuming from {ckpt.name} instead, its later steps are redone",
                    RunDirWarning,
                    stacklevel=2,
                )
            return ckpt
        damaged.append((ckpt, problems))
    if damaged:
        detail = "; ".join(f"{p.name}: {', '.join(problems)}" for p, problems in damaged)
        raise checkpoint_error(f"{root}: no intact checkpoint to resume from ({detail})")
    return None


# ---- JSON lines and atomic writes (also the logs': tltrun.train.run_logs) ----------------


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def write_jsonl_atomic(path: Path, rows: list[dict[str, Any]]) -> None:
    """``path`` holding one JSON line per row, replaced whole (a kill leaves the old file or
    the new one, never a torn one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(path, "".join(json.dumps(row) + "\n" for row in rows))


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_state(
    tmp_dir: Path,
    next_step: int,
    num_workers: int | None = None,
    data_position: dict[str, Any] | None = None,
) -> None:
    """``state.json`` (the next step; the world size that wrote the per-rank files; the data
    position of the next step), then the manifest of the whole directory (which fsyncs every
    file)."""
    state: dict[str, Any] = {"next_step": next_step}
    if num_workers is not None:
        state["num_workers"] = num_workers
    if data_position is not None:
        state["data_position"] = data_position
    (tmp_dir / "state.json").write_text(json.dumps(state) + "\n")
    write_manifest(tmp_dir)


def commit(tmp_dir: Path, final_dir: Path) -> None:
    """Rename the finished ``tmp_dir`` into place. A checkpoint of the same step (a redone step)
    is first renamed to a ``.tmp_`` name, so a kill in between leaves a leftover that resume
    deletes, never a half-deleted checkpoint under a valid name."""
    if final_dir.exists():
        old = final_dir.with_name(".tmp_old_" + final_dir.name)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final_dir, old)
        shutil.rmtree(old)
    os.rename(tmp_dir, final_dir)
    fsync_dir(final_dir.parent)


def prune_checkpoints(out: Path, keep: int, committed: int) -> list[Path]:
    """Right after checkpoint ``committed`` (its next step) was committed: delete all but the
    newest ``keep`` checkpoints up to it (``keep`` 0: delete none); returns the deleted. Later
    ones (damaged ones a resume skipped, replaced when their step is redone) are left alone,
    so they never push out the intact ones. Each is renamed to a ``.tmp_`` name first, as
    ``commit`` does, so a kill mid-delete leaves a leftover that resume deletes, never a
    half-deleted checkpoint."""
    root = out / "ckpt"
    if keep < 1 or not root.is_dir():
        return []
    found = sorted(p for p in root.iterdir() if CKPT_RE.match(p.name))
    doomed = [p for p in found if int(CKPT_RE.match(p.name)[1]) <= committed][:-keep]
    for ckpt in doomed:
        old = ckpt.with_name(".tmp_old_" + ckpt.name)
        shutil.rmtree(old, ignore_errors=True)
        os.rename(ckpt, old)
        shutil.rmtree(old)
    return doomed


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

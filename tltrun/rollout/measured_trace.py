"""Measured tlt-traces: what a rollout really did, in the simulator's trace format, so that a
simulated and a measured step can be put side by side (DESIGN.md, "Trace format").

* ``requests_from_step``: a trace step -> engine requests that replay it exactly (synthetic
  prompts of the recorded prompt lengths, ``ignore_eos``, ``max_new_tokens`` = the recorded
  response length). Request ids are ``"{prompt_id}/{response index}"``.
* ``measured_step``: a ``RolloutResult`` -> ``tltsim.trace.schema.Step`` with one Response per output
  (tokens, finish, accept_hist) grouped by prompt, plus the step's ``measured`` block, a
  ``tltsim.trace.measured.MeasuredStep``: ``rollout_s``, ``policy`` (name, iterations per
  strategy, and the ``config`` / ``seed`` the policy object was built with when given),
  ``hardware``, ``backend``, decode/SD/re-prefill seconds and tokens, mean accept length,
  ``accept_hist_by_strategy`` (the step's) and ``response_accept_hist_by_strategy`` (each
  response's), ``share_prompts``. With the ``max_running_requests`` (and, for several workers,
  ``instance_prompts``) the caller adds, that is everything ``tltsim compare`` reads
  (``tltsim.fidelity.measured_run``).
* ``accept_hist_by_strategy``: verify outcomes per strategy of a list of iterations.

Strategy keys name the drafter (issue #20): an EAGLE iteration's key is its strategy
(``"6_1_6"``), a history-drafter iteration's its arm (``"history:6_1_6"``,
``iteration_arm``), in ``accept_hist_by_strategy``, ``policy.iterations_per_strategy`` and each
response's histograms alike, so a trace keeps the drafters apart (and is then version 2,
``tltsim.trace.schema.version_of``). A response's ``accept_hist`` counts all its verifies.
* ``hardware_name``: a one-line description of the device the engine ran on.

Save with ``tltsim.trace.files.save_trace(Trace(meta, steps), path)`` (JSON keeps everything).
"""

from __future__ import annotations

import dataclasses
import os
import platform
from collections import Counter
from typing import Any

import torch

from tltrun.rollout.interface import Request, RolloutResult
from tltrun.rollout.scheduler import add_to_hist
from tltsim.trace.measured import MeasuredStep, PolicyRecord
from tltsim.trace.schema import Prompt, Response, Step


def request_id(prompt_id: str, index: int) -> str:
    return f"{prompt_id}/{index}"


def prompt_of(request_id_: str) -> str:
    """The prompt id of a request id made by ``request_id`` (everything before the last '/')."""
    head, sep, _ = request_id_.rpartition("/")
    return head if sep else request_id_


def requests_from_step(
    step: Step, vocab_size: int, seed: int, first_token: int = 0
) -> list[Request]:
    """Replay requests for one trace step. Prompt tokens are drawn (seeded, same prompt for
    every response of a group) from ``[first_token, vocab_size)`` — lengths are what a trace
    records, so lengths are what a replay reproduces. ``Request.prompt_id``, the history
    drafter's key (issue #20), is ``"step{N}/{prompt id}"``: the replay draws new prompt tokens
    for every step, so even where the trace's ids name the same prompt across steps
    (``MeasuredStep.is_prompt_id_stable``) the replayed tokens differ and must not pool the
    history of unrelated rollouts."""
    if not 0 <= first_token < vocab_size:
        raise ValueError(f"first_token must be in [0, {vocab_size}), got {first_token}")
    gen = torch.Generator().manual_seed(seed)
    requests = []
    for p in step.prompts:
        prompt = tuple(
            torch.randint(first_token, vocab_size, (p.prompt_tokens,), generator=gen).tolist()
        )
        for i, r in enumerate(p.responses):
            requests.append(
                Request(
                    request_id(p.id, i),
                    prompt,
                    r.tokens,
                    ignore_eos=True,
                    prompt_id=f"step{step.step}/{p.id}",
                )
            )
    return requests


def hardware_name(device: str | torch.device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    return f"{cpu_model()}, {os.cpu_count()} CPUs, {torch.get_num_threads()} torch threads"


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def rollout_summary(result: RolloutResult) -> dict[str, Any]:
    """Seconds and tokens by kind of iteration, and the mean accept length (tokens emitted per
    request per verify, incl. the bonus/correction token)."""
    its = result.iterations
    decode = [i for i in its if not i.is_prefill]
    sd = [i for i in decode if i.strategy != "off"]
    reprefill = [i for i in its if i.is_drafter_prefill]
    num_verifies = sum(len(i.accept_lens) for i in sd)
    accepted = sum(sum(i.accept_lens) for i in sd)
    decode_tokens = sum(i.num_new_tokens for i in decode)
    decode_s = sum(i.wall_s for i in decode)
    return {
        "rollout_s": result.wall_s,
        "prefill_s": sum(i.wall_s for i in its if i.is_prefill and not i.is_drafter_prefill),
        "drafter_prefill_s": sum(i.wall_s for i in reprefill),
        "decode_s": decode_s,
        "sd_s": sum(i.wall_s for i in sd),
        "num_iterations": len(decode),
        "num_sd_iterations": len(sd),
        "decode_tokens": decode_tokens,
        "decode_tokens_per_s": decode_tokens / decode_s if decode_s > 0 else 0.0,
        "total_tokens": sum(len(o.output_token_ids) for o in result.outputs),
        "mean_accept_len": (accepted + num_verifies) / num_verifies if num_verifies else 0.0,
    }


def iteration_arm(it) -> str:
    """An IterationRecord's strategy key: its strategy, with a drafter other than EAGLE in
    front (``"history:6_1_6"``, as ``tltsim.policy.SpecDecision.arm`` names it)."""
    if it.drafter is None or it.drafter == "eagle":
        return it.strategy
    return f"{it.drafter}:{it.strategy}"


def accept_hist_by_strategy(iterations) -> dict[str, list[int]]:
    """{strategy or arm: [number of verifies that accepted 0, 1, 2, ... drafts]} over
    ``iterations`` (the fit contract's field, ``tltsim.fidelity.fit``; TLT mixes strategies
    within a step)."""
    hist: dict[str, list[int]] = {}
    for it in iterations:
        for n in it.accept_lens:
            add_to_hist(hist.setdefault(iteration_arm(it), []), n)
    return hist


def instance_prompts(results: list[RolloutResult]) -> list[list[str]]:
    """One list per engine instance (worker) of the prompt ids it served, in output order."""
    return [list(dict.fromkeys(prompt_of(o.id) for o in r.outputs)) for r in results]


def measured_step(
    step: int,
    result: RolloutResult,
    prompt_tokens: dict[str, int] | None = None,
    policy_name: str = "",
    hardware: str = "",
    extra: dict[str, Any] | None = None,
    policy_config: dict[str, Any] | None = None,
    policy_seed: int | None = None,
) -> Step:
    """Group outputs by prompt (request ids ``prompt/i``, order of first appearance).
    ``policy_config`` / ``policy_seed``: the ``make_policy`` settings and seed of the policy
    that ran (recorded so that ``tltsim compare`` rebuilds the same policy). ``extra``: more
    ``MeasuredStep`` fields the caller measured (``train_s``, ``max_running_requests``, ...;
    lists become tuples); a name that is no field raises TypeError."""
    groups: dict[str, list] = {}
    for out in result.outputs:
        groups.setdefault(prompt_of(out.id), []).append(out)
    prompts = []
    for pid, outs in groups.items():
        responses = tuple(
            Response(
                tokens=len(o.output_token_ids),
                finish=o.finish,
                accept_hist=tuple(o.accept_hist) or None,
            )
            for o in outs
        )
        num_prompt = prompt_tokens[pid] if prompt_tokens else len(outs[0].prompt_token_ids)
        prompts.append(Prompt(id=pid, prompt_tokens=num_prompt, responses=responses))
    strategies = Counter(iteration_arm(i) for i in result.iterations if not i.is_prefill)
    config = None
    if policy_config is not None:  # as JSON has it: tuples as lists
        config = {k: list(v) if isinstance(v, tuple) else v for k, v in policy_config.items()}
    policy = PolicyRecord(
        name=policy_name,
        iterations_per_strategy=dict(sorted(strategies.items())),
        config=config,
        seed=policy_seed,
    )
    measured = MeasuredStep(
        **rollout_summary(result),
        policy=policy,
        hardware=hardware,
        backend=result.backend,
        share_prompts=result.shares_prompts,
        prefix_block_tokens=result.prefix_block_tokens,
        accept_hist_by_strategy=_frozen(accept_hist_by_strategy(result.iterations)),
        # per prompt, one {strategy: hist} per response in the order of its prompt's responses
        response_accept_hist_by_strategy={
            pid: tuple(_frozen(o.accept_hist_by_strategy) for o in outs)
            for pid, outs in groups.items()
            if any(o.accept_hist_by_strategy for o in outs)
        },
    )
    if extra:
        measured = dataclasses.replace(measured, **{k: _frozen(v) for k, v in extra.items()})
    return Step(step=step, prompts=tuple(prompts), measured=measured)


def _frozen(value: Any) -> Any:
    """Lists (nested, also inside dicts) as tuples: MeasuredStep's sequence fields."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen(x) for x in value)
    if isinstance(value, dict):
        return {k: _frozen(v) for k, v in value.items()}
    return value

"""The vLLM backend's per-request bookkeeping (``Live``) and what one vLLM engine step did, as
the rollout interface's ``IterationRecord`` (``step_record``): tokens each request emitted,
accept lengths of the requests that verified drafts, the strategy vLLM ran, prefill and the
drafter re-prefill of switch mode. Used by ``tltrun.rollout.vllm_backend.VLLMBackend``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tltrun.rollout.interface import IterationRecord, Request, RequestOutput
from tltrun.rollout.scheduler import add_to_hist
from tltsim.policy import SpecDecision


@dataclass
class Live:
    """One request during a rollout. ``engine_id`` changes when switch mode resubmits it."""

    request: Request
    engine_id: str
    num_prefix_tokens: int = 0  # tokens generated before the current submission
    tokens: list[int] = field(default_factory=list)
    accept_hist: list[int] = field(default_factory=list)
    accept_by_strategy: dict[str, list[int]] = field(default_factory=dict)
    first_token_s: float | None = None
    finish_s: float = 0.0
    finish: str | None = None

    def output(self) -> RequestOutput:
        return RequestOutput(
            id=self.request.id,
            prompt_token_ids=self.request.prompt_token_ids,
            output_token_ids=self.tokens,
            finish=self.finish or "length",
            accept_hist=self.accept_hist,
            first_token_s=self.first_token_s or 0.0,
            finish_s=self.finish_s,
            accept_hist_by_strategy=self.accept_by_strategy,
        )


def step_record(
    outputs: list[Any],
    by_engine_id: dict[str, Live],
    start_s: float,
    wall_s: float,
    now_s: float,
    pending: SpecDecision | None,
    stats: list[Any],
    spec_drafter: str | None,
    max_draft_steps: int,
) -> tuple[IterationRecord, int] | None:
    """One engine step's IterationRecord and the tokens its decoding requests emitted (not the
    first tokens of requests whose prefill ran in it), from vLLM's ``outputs`` and the step's
    scheduler ``stats``; each request's tokens and histograms are brought up to date.
    ``pending`` is the decision whose drafts the step verified. None: nothing was emitted."""
    deltas: dict[str, int] = {}  # tokens each request emitted in this step
    accepted: dict[str, int] = {}  # draft tokens each request had accepted (if drafts ran)
    touched: dict[str, Live] = {}
    context_tokens, num_first, num_reprefilled = 0, 0, 0
    for out in outputs:
        live = by_engine_id.get(out.request_id)
        if live is None or live.finish is not None:
            continue
        completion = out.outputs[0]
        metrics = completion.spec_decode_metrics
        new = list(completion.token_ids)[len(live.tokens) - live.num_prefix_tokens :]
        if new:
            is_first = len(live.tokens) == live.num_prefix_tokens
            # KV tokens attended: as the torch engine counts them, all but the pending token
            # of a decoding request (its prefill computes the whole prompt and prefix)
            context_tokens += len(live.request.prompt_token_ids) + len(live.tokens) - (not is_first)
            if is_first:
                num_first += 1  # first token of this submission: its prefill ran now
                num_reprefilled += live.num_prefix_tokens > 0
            live.first_token_s = now_s if live.first_token_s is None else live.first_token_s
            live.tokens.extend(new)
            live.finish_s = now_s
            deltas[live.request.id] = len(new)
            touched[live.request.id] = live
            # Emitted = accepted + the bonus/correction token, except in a request's last
            # step, cut at max_tokens or EOS: there vLLM's own per-step count is exact. A
            # request prefilled in this step verified nothing (vLLM's histogram counts no
            # verify for it either; recorded as one accepting 0, it skewed accept lengths).
            is_cut = out.finished and metrics is not None and metrics.per_step_accepted
            if not is_first:
                accepted[live.request.id] = (
                    metrics.per_step_accepted[-1] if is_cut else len(new) - 1
                )
        if out.finished:
            live.finish = "stop" if completion.finish_reason == "stop" else "length"
            live.accept_hist = add_hist(
                live.accept_hist, list(metrics.histogram if metrics else [])
            )
            if not any(live.accept_hist):
                live.accept_hist = []  # no verify step carried drafts (as the torch engine)
    if not deltas:
        return None
    spec = [s.spec_decoding_stats for s in stats if s.spec_decoding_stats]
    num_drafts = sum(s.num_drafts for s in spec)
    k = round(sum(s.num_draft_tokens for s in spec) / num_drafts) if num_drafts else 0
    drafter = spec_drafter if k else None
    if k and pending is not None and pending.enabled:
        # the strategy is the k the verified decision scheduled: vLLM drafts fewer where a
        # request nears its max_tokens (a static 12_1_12 was recorded as 10_1_10, 7_1_7, ...),
        # and ngram proposes fewer, or none, where the match's continuation is shorter
        k = min(pending.draft_steps, max_draft_steps)
    num_active = max((s.num_running_reqs for s in stats), default=len(deltas))
    arm = f"{k}_1_{k}" if drafter != "history" else f"history:{k}_1_{k}"
    if k:  # the same (strategy, accepted) pairs the iteration record carries
        for rid, n in accepted.items():
            add_to_hist(touched[rid].accept_by_strategy.setdefault(arm, []), n)
    record = IterationRecord(
        start_s=start_s,
        wall_s=wall_s,
        num_active=max(num_active, len(deltas)),
        num_new_tokens=sum(deltas.values()),
        context_tokens=context_tokens,
        is_prefill=num_first > 0,
        strategy=f"{k}_1_{k}" if k else "off",
        accept_lens=tuple(accepted.values()) if k else (),
        # switch mode's re-prefill: TLT's cost of turning SD on (target and drafter here)
        is_drafter_prefill=num_reprefilled > 0,
        drafter=drafter,
    )
    return record, sum(deltas[rid] for rid in accepted)


def add_hist(a: list[int], b: list[int]) -> list[int]:
    n = max(len(a), len(b))
    return [x + y for x, y in zip(a + [0] * (n - len(a)), b + [0] * (n - len(b)), strict=True)]

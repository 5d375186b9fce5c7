"""A worker's side of one RL step's responses in ``tltrun train`` (tltrun.train.worker): the
step's GRPO groups and requests, their rewards (the run's reward in the out-of-process
``RewardPool``, then DAPO shaping), the rows of the rollout dump (``rollouts/step_<n>.jsonl``)
and the evaluation on the held-out prompts. Each worker runs this on its own share of the
prompts; rank 0 gathers the results (tltrun.train.step_log). Not run directly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tltrun.data.rewards import RewardItem, RewardPool, Shaping, apply_shaping
from tltrun.data.rows import PromptRow
from tltrun.data.scoring import THINK_CLOSE, THINK_OPEN
from tltrun.data.tokenizer import Prompt, TextTokenizer
from tltrun.rollout.interface import Request, RequestOutput, SamplingParams
from tltrun.train.config import TrainConfig
from tltrun.train.grpo import Sample, group_advantages
from tltsim.policy import make_policy

# Per response: (shaped reward, raw reward, error message or "")
Scored = tuple[float, float, str]


def group_names(rows) -> list[str]:
    """The name of each row's GRPO group in a step: its dataset prompt id, so that the trace's
    prompt ids name prompts across steps (``MeasuredStep.is_prompt_id_stable``: a prompt's
    earlier rollouts are the history drafter's history, issue #20); a prompt drawn twice in
    one step gets ``#1``, ``#2``, ... on its later copies (their groups stay apart)."""
    seen: dict[str, int] = {}
    names = []
    for row in rows:
        k = seen.get(row.prompt_id, 0)
        seen[row.prompt_id] = k + 1
        names.append(row.prompt_id if k == 0 else f"{row.prompt_id}#{k}")
    return names


@dataclass(frozen=True, kw_only=True)
class EvalSummary:
    """One worker's evaluation at one step (its share of the evaluation rows)."""

    rewards: list[float]  # raw rewards (unshaped), one per response
    lengths: list[int]  # response tokens, one per response
    num_truncated: int  # responses that hit max_new_tokens
    num_prompts: int
    errors: list[str]  # reward errors, each with its sample id


def opens_thinking(tok: TextTokenizer, prompt: Prompt) -> bool:
    """Whether the rendered prompt leaves a ``<think>`` open, so that the response starts
    mid-thought (``tltrun.data.scoring.final_part``): DeepSeek-R1 distills' templates end the
    generation prompt in ``<think>\\n``, and a final assistant message the response continues may
    stop inside its thinking (``<think>\\n5 plus 9 is``; only a prompt *ending* in ``<think>``
    counted, and a response cut there mid-thought scored its whole text). For chat messages:
    open where the last ``<think>`` after the last user or system message's text (so that a
    question that mentions ``<think>`` opens nothing) has no later ``</think>``. A plain-text
    prompt without a template has no such structure: open where it ends in ``<think>``."""
    text = tok.prompt_text(prompt)
    if isinstance(prompt, str) and not tok.is_chat_template:
        return text.rstrip().endswith(THINK_OPEN)
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    end = len(text)
    last = messages[-1]
    if last.get("role") == "assistant" and isinstance(last.get("content"), str):
        # the continued message is the prompt's tail: the question is looked for before it (a
        # draft that repeats the question would otherwise be taken for it)
        at = text.rfind(last["content"].strip())
        end = at if at >= 0 and last["content"].strip() else end
    asked = [m.get("content") for m in messages if m.get("role") != "assistant"]
    asked = [c.strip() for c in asked if isinstance(c, str) and c.strip()]
    if asked and (at := text.rfind(asked[-1], 0, end)) >= 0:
        text = text[at + len(asked[-1]) :]
    return text.rfind(THINK_OPEN) > text.rfind(THINK_CLOSE)


class ResponseScorer:
    """Rewards, dump rows and evaluation of one worker's responses. Holds no state of its own
    between steps: the tokenizer and reward pool are the worker's (it closes the pool)."""

    def __init__(self, cfg: TrainConfig, tok: TextTokenizer, rewards: RewardPool, shaping: Shaping):
        self.cfg, self.tok, self.rewards, self.shaping = cfg, tok, rewards, shaping

    def step_requests(
        self, rows: list[PromptRow], share: tuple[int, int]
    ) -> tuple[list[Request], dict[str, PromptRow]]:
        """This worker's requests of a step (``group_size`` per prompt of its ``share``, a
        (start, count) slice of the step's rows) and each group's row by group name."""
        start, count = share
        requests, by_group = [], {}
        names = group_names(rows)
        for row, name in zip(
            rows[start : start + count], names[start : start + count], strict=True
        ):
            ids = tuple(self.tok.encode_prompt(row.prompt))
            # prompt_id: the history drafter's key for this prompt's earlier rollouts (#20)
            for g in range(self.cfg.group_size):
                requests.append(
                    Request(f"{name}/{g}", ids, self.cfg.max_new_tokens, prompt_id=row.prompt_id)
                )
            by_group[name] = row
        return requests, by_group

    def score(
        self, step: int, requests, outputs, by_group
    ) -> tuple[list[RewardItem], list[Scored]]:
        """Per response its reward input (prompt and response text) and (shaped reward, raw
        reward, error or ""); the rewards run in the pool."""
        items = []
        thinking: dict[str, bool] = {}  # by group: its requests share the prompt
        for r, o in zip(requests, outputs, strict=True):
            group = r.id.rpartition("/")[0]
            row = by_group[group]
            if group not in thinking:
                thinking[group] = opens_thinking(self.tok, row.prompt)
            items.append(
                RewardItem(
                    sample_id=f"step{step}/{r.id}",
                    prompt=row.prompt_text,  # chat messages as "role: content" lines
                    response=self.tok.decode(o.output_token_ids),
                    answer=row.answer,
                    meta=row.meta,
                    is_thinking_open=thinking[group],
                )
            )
        scored = []
        for item, o, outcome in zip(items, outputs, self.rewards.score(items), strict=True):
            # a failed reward scores 0, unshaped (README): its overlong term was added, so a
            # long response whose reward raised scored -1
            shaped = outcome.reward if outcome.error else apply_shaping(
                outcome.reward,
                num_response_tokens=len(o.output_token_ids),
                max_response_tokens=self.cfg.max_new_tokens,
                shaping=self.shaping,
                is_format_ok=outcome.is_format_ok,
            )  # fmt: skip
            source = by_group[o.id.rpartition("/")[0]].source
            error = f"{item.sample_id} ({source}): {outcome.error}" if outcome.error else ""
            scored.append((shaped, outcome.reward, error))
        return items, scored

    def dump_rows(
        self,
        step: int,
        requests: list[Request],
        outputs: list[RequestOutput],
        items: list[RewardItem],
        scored: list[Scored],
        samples: list[Sample],
        by_group: dict[str, PromptRow],
        adv_eps: float,
    ) -> list[dict]:
        """This worker's rows of ``rollouts/step_<n>.jsonl`` (rank 0 writes them all)."""
        if not self.cfg.dump_rollouts:
            return []
        advantages = group_advantages(samples, adv_eps)
        rows = []
        for r, o, item, (reward, raw, error), adv in zip(
            requests, outputs, items, scored, advantages, strict=True
        ):
            row = by_group[r.id.rpartition("/")[0]]
            strategies = {k: sum(v) for k, v in o.accept_hist_by_strategy.items() if sum(v)}
            rows.append(
                {
                    "step": step,
                    "id": r.id,
                    "prompt_id": row.prompt_id,
                    "source": row.source,
                    "prompt": self.tok.prompt_text(row.prompt),  # as the model saw it
                    "response": item.response,
                    "answer": row.answer,
                    "num_prompt_tokens": len(r.prompt_token_ids),
                    "num_response_tokens": len(o.output_token_ids),
                    "finish": o.finish,
                    "reward": reward,
                    **({"raw_reward": raw} if raw != reward else {}),
                    **({"reward_error": error} if error else {}),
                    "advantage": adv,
                    # SD verify iterations per strategy ("off": decoded without SD throughout)
                    "sd_strategies": strategies or {"off": 0},
                }
            )
        return rows

    def is_eval_step(self, step: int, num_eval_rows: int) -> bool:
        every = self.cfg.eval_every
        return bool(every and num_eval_rows) and (
            (step + 1) % every == 0 or step + 1 == self.cfg.num_steps
        )

    def evaluate(self, engine, step: int, share: list[PromptRow]) -> EvalSummary:
        """Greedy (``eval_num_samples`` 1) or sampled responses to this worker's ``share`` of
        the evaluation rows, scored by the run's reward. Training is left exactly as it was:
        the engine's sampling generator is restored, eval requests carry no prompt id (the
        history drafter forgets them), their harvest is discarded, and the run's SD policy is
        not consulted (plain decoding: SD is lossless, the responses are the same)."""
        cfg = self.cfg
        num = cfg.eval_num_samples
        sampling = SamplingParams(0.0) if num == 1 else SamplingParams(cfg.temperature, cfg.top_p)
        requests, by_group = [], {}
        for i, row in enumerate(share):
            ids = tuple(self.tok.encode_prompt(row.prompt))
            requests += [Request(f"e{i}/{g}", ids, cfg.max_new_tokens) for g in range(num)]
            by_group[f"e{i}"] = row
        gen_state = getattr(engine, "generator", None)
        gen_state = gen_state.get_state() if gen_state is not None else None
        if hasattr(engine, "backend"):  # vLLM: seeds per (step, request), no generator
            saved, engine.backend.sampling = engine.backend.sampling, sampling
        else:
            saved, engine.config = engine.config, replace(engine.config, sampling=sampling)
        try:
            result = engine.generate(requests, make_policy("nospec"), step) if requests else None
        finally:
            if hasattr(engine, "backend"):
                engine.backend.sampling = saved
            else:
                engine.config = saved
            if gen_state is not None:
                engine.generator.set_state(gen_state)
            engine.discard_harvest()  # (vLLM's pop_harvest recomputes hidden states)
        outputs = (
            [] if result is None else [{o.id: o for o in result.outputs}[r.id] for r in requests]
        )
        scored = self.score(step, requests, outputs, by_group)[1] if requests else []
        return EvalSummary(
            rewards=[raw for _, raw, _ in scored],
            lengths=[len(o.output_token_ids) for o in outputs],
            num_truncated=sum(o.finish == "length" for o in outputs),
            num_prompts=len(share),
            errors=[e for _, _, e in scored if e],
        )

"""What a history draft could reach on realized GRPO rollouts (issue #20), for
``benchmarks/bench_history.py --grpo``: the ceiling of any point-mass draft from the prompt's group
(``point_mass_ceiling``), and the one-token acceptance of a draft sampled from the history's
continuation counts against the most frequent continuation (``count_draft_acceptance``, p from
the target), each from a run's step-0 rollout dump; and both the history drafter replayed and
the ceiling on the built-in task's own reference solutions (``reference_bounds``: what a model
that has learned the task exactly would give). Pure Python but for the target's forward.
"""

from __future__ import annotations

import json
import random
import statistics
from pathlib import Path

from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter
from tltrun.model.tokenizer import CharTokenizer
from tltrun.train.tasks import TaskConfig, sample_problem, worked_solution


def _as_text(ids: list[int]) -> str:
    """Token ids as one character each, so ``str.find`` searches id sequences (fast in C)."""
    return "".join(chr(0x100 + i) for i in ids)


def _lockstep_index(head: str, texts: list[str], k: int, t: int) -> list[str]:
    """What the history drafter of response k sees after its first t tokens: the prompt and its
    own output, and each sibling's first t tokens (all of it once finished)."""
    return [head + texts[k][:t]] + [head + other[:t] for j, other in enumerate(texts) if j != k]


def point_mass_ceiling(
    prompt: list[int],
    responses: list[list[int]],
    *,
    max_draft_tokens: int = 8,
    ngram_min: int = HistoryConfig.ngram_min,
    ngram_max: int = HistoryConfig.ngram_max,
) -> list[int]:
    """The accept length per iteration that NO point-mass draft from the prompt's group (the
    history drafter without its cross-prompt tier) can beat on one group's realized responses
    (same prompt, generated in lockstep): at each iteration, every continuation of every
    occurrence of the last n tokens (n from ngram_min to ngram_max) in the index the history
    drafter sees at that moment (the prompt and the sequence's own output, each sibling's
    first t tokens or all of it once finished) is tried, and the one that matches the realized
    tokens longest counts (a tree of unbounded width, picked with hindsight). Why this bounds a
    real run: a point-mass draft x is accepted with probability p(x), which is the probability
    that the target's own sample is x, so replaying the realized tokens gives a run's expected
    accept length. Returns accepted + 1 per iteration, over all responses of the group."""
    accepts: list[int] = []
    head = _as_text(prompt)
    texts = [_as_text(r) for r in responses]
    for k, resp in enumerate(texts):
        t = 0
        while t < len(resp):
            index = _lockstep_index(head, texts, k, t)
            own = index[0]
            target = resp[t : t + max_draft_tokens]
            best = 0
            for n in range(ngram_min, min(ngram_max, len(own)) + 1):
                context = own[-n:]
                for text in index:
                    at = text.find(context)
                    while at != -1:
                        cont = text[at + n : at + n + max_draft_tokens]
                        a = 0
                        while a < len(cont) and a < len(target) and cont[a] == target[a]:
                            a += 1
                        best = max(best, a)
                        at = text.find(context, at + 1)
            step = min(best + 1, len(resp) - t)
            accepts.append(step)
            t += step
    return accepts


def count_draft_acceptance(
    prompt: list[int],
    responses: list[list[int]],
    probs: list[list[list[float]]],
    *,
    ngram_min: int = HistoryConfig.ngram_min,
    ngram_max: int = HistoryConfig.ngram_max,
) -> tuple[list[float], list[float]]:
    """Whether a draft SAMPLED from the history could beat point masses: per position of the
    group's realized responses, the next tokens q that follow the longest context (ngram_max
    down to ngram_min) occurring in the lockstep index of ``point_mass_ceiling``, counted over
    occurrences, and the target's distribution p there (``probs[k][t]``). Returns the
    acceptance probability of one drafted token, per position: (point mass on q's most frequent
    token: p(x); x sampled from q: sum_x min(p(x), q(x)), speculative sampling's). 0 where no
    context matches."""
    head = _as_text(prompt)
    texts = [_as_text(r) for r in responses]
    point, sampled = [], []
    for k, resp in enumerate(texts):
        for t in range(len(resp)):
            index = _lockstep_index(head, texts, k, t)
            own = index[0]
            counts: dict[str, int] = {}
            for n in range(min(ngram_max, len(own)), ngram_min - 1, -1):
                for text in index:
                    at = text.find(own[-n:])
                    while at != -1 and at + n < len(text):
                        counts[text[at + n]] = counts.get(text[at + n], 0) + 1
                        at = text.find(own[-n:], at + 1)
                if counts:
                    break
            p = probs[k][t]
            total = sum(counts.values())
            top = max(counts, key=counts.get) if counts else None
            point.append(p[ord(top) - 0x100] if top is not None else 0.0)
            sampled.append(sum(min(p[ord(c) - 0x100], m / total) for c, m in counts.items()))
    return point, sampled


def step0_bounds(run_dir: Path, model_dir: Path) -> dict[str, float]:
    """On a run's step-0 rollout dump (read once): ``point_mass_ceiling``'s mean accept length
    ("ceiling") and ``count_draft_acceptance``'s mean one-token acceptances ("point_mass",
    "sampled"), p from the target at the run's temperature (one forward per response)."""
    import torch

    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.model.transformer import CausalContext

    model = load_hf(model_dir).eval()
    temperature = json.loads((run_dir / "config.json").read_text())["train"]["temperature"]
    accepts: list[int] = []
    point, sampled = [], []
    for prompt, responses in _step0_groups(run_dir, model_dir):
        accepts += point_mass_ceiling(prompt, responses)
        probs = []
        for resp in responses:
            ids = torch.tensor([prompt + resp])  # (1, T)
            with torch.no_grad():
                logits, _ = model(ids, torch.arange(ids.shape[1])[None], CausalContext())
            rows = logits[0, len(prompt) - 1 : -1].float() / temperature  # (len(resp), V)
            probs.append(torch.softmax(rows, dim=-1).tolist())
        p, q = count_draft_acceptance(prompt, responses, probs)
        point += p
        sampled += q
    return {
        "ceiling": statistics.fmean(accepts),
        "point_mass": statistics.fmean(point),
        "sampled": statistics.fmean(sampled),
    }


def _step0_groups(run_dir: Path, model_dir: Path) -> list[tuple[list[int], list[list[int]]]]:
    """(prompt ids, response ids) per prompt group of a run's step-0 rollout dump, re-encoded
    by the model's tokenizer (for the built-in task's character tokenizer exactly the ids
    generated; a BPE may split a decoded text differently)."""
    from tltrun.data.tokenizer import load_tokenizer

    tok = load_tokenizer(model_dir)
    groups: dict[str, list[dict]] = {}
    with open(run_dir / "rollouts" / "step_000000.jsonl") as f:
        for line in f:
            row = json.loads(line)
            groups.setdefault(row["prompt_id"], []).append(row)
    # a response that stopped generated one of the stop ids too (decoding dropped it)
    return [
        (
            tok.encode_prompt(rows[0]["prompt"]),
            [
                tok.encode(r["response"]) + ([tok.info.eos_ids[0]] if r["finish"] == "stop" else [])
                for r in rows
            ],
        )
        for rows in groups.values()
    ]


def replay_lockstep(
    prompt: list[int], responses: list[list[int]], draft_tokens: int, max_branches: int = 1
) -> list[int]:
    """``replay_lockstep_groups`` of one group."""
    return replay_lockstep_groups([(prompt, responses)], draft_tokens, max_branches)


def replay_lockstep_groups(
    groups: list[tuple[list[int], list[list[int]]]],
    draft_tokens: int,
    max_branches: int = 1,
    is_cross_prompt: bool = True,
) -> list[int]:
    """The history drafter itself on the realized responses of ``groups`` (prompt, responses),
    all generated in lockstep as one engine's running batch (every unfinished sequence
    proposes, then every one commits: a sequence's tokens become history at the next
    iteration): the longest prefix of the realized tokens that one of its ``max_branches``
    proposed continuations (``propose_tree``; 1: ``propose``'s chain) matches, plus the
    target's own token. With ``is_cross_prompt`` other groups' sequences are history too
    (``HistoryConfig.is_cross_prompt``). Replaying realized tokens gives the expected accept
    length of point-mass drafts (see ``point_mass_ceiling``). Returns accepted + 1 per
    iteration."""
    drafter = HistoryDrafter(HistoryConfig(is_cross_prompt=is_cross_prompt))
    responses = {}
    for g, (prompt, group) in enumerate(groups):
        for k, response in enumerate(group):
            drafter.add((g, k), g, prompt)
            responses[(g, k)] = response
    pos = dict.fromkeys(responses, 0)
    accepts: list[int] = []
    while True:
        running = [key for key, r in responses.items() if pos[key] < len(r)]
        if not running:
            return accepts
        steps = {}
        for key in running:
            real = responses[key][pos[key] : pos[key] + draft_tokens]
            best = 0
            for branch in drafter.propose_tree(key, draft_tokens, max_branches):
                a = 0
                while a < len(branch) and a < len(real) and branch[a] == real[a]:
                    a += 1
                best = max(best, a)
            steps[key] = min(best + 1, len(responses[key]) - pos[key])
        for key, step in steps.items():
            drafter.extend(key, responses[key][pos[key] : pos[key] + step])
            pos[key] += step
            accepts.append(step)


def reference_bounds(
    *,
    group_size: int,
    num_groups: int = 64,
    draft_tokens: tuple[int, ...] = (2, 4, 8),
    max_branches: tuple[int, ...] = (1, 16),
    concurrent_groups: tuple[int, ...] = (2, 64),
    seed: int = 0,
) -> list[dict]:
    """The built-in task's reference solutions (``worked_solution``: a model that has learned
    the task exactly, sampled at temperature 1; each sample draws its own check lines and
    recheck passes), ``num_groups`` prompts x ``group_size`` samples in the character
    tokenizer's ids, each ending in EOS: per chain length, the mean accept length of the
    history drafter replayed in lockstep one group at a time (``replay_lockstep``, one row per
    ``max_branches``), of ``point_mass_ceiling`` (no draft from the prompt's group, chain or
    tree, beats it), and of the chain with the cross-prompt index when ``concurrent_groups``
    groups run at once (``replay_lockstep_groups``: 2 is a worker's share of bench_history's
    GRPO steps, 4 prompts on 2 workers; a run of 512 prompts on 8 workers has 64). What no
    better SFT model could raise: the task's own text bounds it."""
    task, tok, rng = TaskConfig(), CharTokenizer(), random.Random(seed)
    groups = []
    for _ in range(num_groups):
        problem = sample_problem(task, rng)
        prompt = tok.encode(problem.prompt)
        responses = [
            tok.encode(worked_solution(problem, task, rng), add_bos=False, add_eos=True)
            for _ in range(group_size)
        ]
        groups.append((prompt, responses))
    rows = []
    for k in draft_tokens:
        row: dict = {"draft_tokens": k}
        for b in max_branches:
            row[f"replay_branches_{b}"] = statistics.fmean(
                a for prompt, responses in groups for a in replay_lockstep(prompt, responses, k, b)
            )
        row["ceiling"] = statistics.fmean(
            a
            for prompt, responses in groups
            for a in point_mass_ceiling(prompt, responses, max_draft_tokens=k)
        )
        for n in concurrent_groups:
            row[f"cross_prompt_{n}"] = statistics.fmean(
                a
                for i in range(0, num_groups, n)
                for a in replay_lockstep_groups(groups[i : i + n], k)
            )
        rows.append(row)
    return rows

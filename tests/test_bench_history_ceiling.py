"""benchmarks/history_bounds.py's bounds of history drafts on realized rollouts,
bench_history.py's GRPO checks (benchmarks/grpo_checks.py) and its cost tables at toy sizes."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import grpo_checks  # noqa: E402
import history_bounds  # noqa: E402

from tltrun.model.history_drafter import HistoryConfig, HistoryDrafter  # noqa: E402

ceiling = history_bounds.point_mass_ceiling


def test_a_response_that_repeats_its_prompt_is_drafted_in_full_chains():
    # [2, 3] first occurs in the prompt with 6 tokens after it (then the prompt ends): 6 + the
    # bonus; from then on the output itself holds 8 tokens of continuation: 8 + the bonus
    accepts = ceiling([1, 2, 3] * 3, [[1, 2, 3] * 10], max_draft_tokens=8)
    assert accepts == [7, 9, 9, 5]


def test_tokens_never_seen_before_are_never_drafted():
    accepts = ceiling([1, 2], [list(range(10, 40))])
    assert accepts == [1] * 30


def test_a_finished_sibling_is_copied_but_a_running_one_only_up_to_where_it_is():
    unique = list(range(200, 225))
    shared = list(range(100, 120))
    own = unique + shared
    finished = ceiling([1], [own, shared], max_draft_tokens=4)  # the sibling stops at 20
    # unique tokens, then shared[0] and shared[1] before [shared0, shared1] matches the
    # sibling, whose 18 further tokens come 4 per draft + the bonus
    assert finished[:31] == [1] * 27 + [5, 5, 5, 3]  # own's 31 iterations, then the sibling's
    assert ceiling([1], [own]) == [1] * len(own)
    # an identical sibling in lockstep is never ahead: it offers nothing
    assert ceiling([1], [own, own])[: len(own)] == [1] * len(own)


def test_the_ceiling_bounds_what_the_history_drafter_proposes():
    """HistoryDrafter's own chain, replayed on the same rollouts, never beats the ceiling."""
    rng = random.Random(0)
    words = [[rng.randrange(50) for _ in range(rng.randrange(2, 6))] for _ in range(8)]
    prompt = [rng.randrange(50) for _ in range(12)]
    group = [sum((rng.choice(words) for _ in range(12)), []) for _ in range(4)]
    bound = ceiling(prompt, group, max_draft_tokens=6)
    drafter = HistoryDrafter(HistoryConfig())
    chain = []
    for k, resp in enumerate(group):  # own index only (the siblings add to the ceiling)
        drafter.add(("own", k), ("g", k), prompt)
        t = 0
        while t < len(resp):
            proposal = drafter.propose(("own", k), 6)
            a = 0
            while a < len(proposal) and t + a < len(resp) and proposal[a] == resp[t + a]:
                a += 1
            step = min(a + 1, len(resp) - t)
            chain.append(step)
            drafter.extend(("own", k), resp[t : t + step])
            t += step
    assert sum(chain) == sum(bound) == sum(len(r) for r in group)
    assert len(chain) >= len(bound)  # fewer iterations: a longer mean accept length


def test_the_lockstep_replay_copies_a_finished_sibling_through_the_drafter():
    shared = list(range(100, 120))
    own = list(range(200, 225)) + shared
    accepts = history_bounds.replay_lockstep([1], [shared, own], draft_tokens=4)
    # shared: 20 new tokens, 1 per iteration; own: 25 new ones, then shared[0] and shared[1]
    # before [shared0, shared1] matches the finished sibling: its 18 further tokens 4 per
    # draft + the bonus (as the ceiling's case above)
    assert sorted(accepts) == [1] * 47 + [3, 5, 5, 5]
    assert sum(accepts) == len(shared) + len(own)


def test_the_cross_prompt_replay_copies_another_prompts_finished_response():
    shared = list(range(100, 120))
    groups = [([1], [shared]), ([2], [list(range(200, 225)) + shared])]
    off = history_bounds.replay_lockstep_groups(groups, 4, is_cross_prompt=False)
    on = history_bounds.replay_lockstep_groups(groups, 4)
    assert off == [1] * (20 + 45)  # nothing to copy within either group
    # as the sibling case above: the other prompt's finished response drafts 4 at a time
    assert sorted(on) == [1] * 47 + [3, 5, 5, 5]


def test_a_tree_reaches_the_continuation_the_chain_does_not_pick():
    # [1, 2] is followed by 3 and by 4 in the prompt; the chain follows one (3), the response
    # takes the other: a tree of 2 continuations holds it (4 accepted + the bonus 9)
    prompt, resp = [1, 2, 3, 1, 2, 4], [[1, 2, 4, 9]]
    assert history_bounds.replay_lockstep(prompt, resp, 4, max_branches=1) == [1, 1, 1, 1]
    assert history_bounds.replay_lockstep(prompt, resp, 4, max_branches=2) == [1, 1, 2]


def test_reference_bounds_are_reproducible_accept_lengths_per_chain_length():
    settings = dict(group_size=3, num_groups=4, draft_tokens=(2, 6), concurrent_groups=(1, 4))
    rows = history_bounds.reference_bounds(**settings)
    assert rows == history_bounds.reference_bounds(**settings)
    assert [r["draft_tokens"] for r in rows] == [2, 6]
    for r in rows:
        for key in ("replay_branches_1", "replay_branches_16", "ceiling", "cross_prompt_4"):
            assert 1.0 <= r[key] <= r["draft_tokens"] + 1
        # one group at a time, the cross-prompt index holds only the group's own sequences
        assert r["cross_prompt_1"] == r["replay_branches_1"]
    assert rows != history_bounds.reference_bounds(**settings, seed=1)


def test_sampled_history_draft_acceptance_is_the_overlap_of_p_and_the_counts():
    """[1, 2] is followed by 3 and by 4 in the prompt: at the third response token both
    continuations count once per indexed copy (q = 1/2, 1/2). The target there puts 1/2 on each:
    a point mass on one is accepted with 1/2, a draft sampled from q with sum min(p, q) = 1.
    Where no context of >= ngram_min tokens is followed by anything, nothing is drafted (0)."""
    uniform = [1 / 6] * 6
    split = [0.0, 0.0, 0.0, 0.5, 0.5, 0.0]
    probs = [[uniform, uniform, split], [uniform, uniform, split]]
    point, sampled = history_bounds.count_draft_acceptance(
        [1, 2, 3, 1, 2, 4], [[1, 2, 3], [1, 2, 4]], probs
    )
    assert point == pytest.approx([0, 0, 0.5, 0, 0, 0.5])
    assert sampled == pytest.approx([0, 0, 1.0, 0, 0, 1.0])
    # a target sure of 3: the point mass (3, first counted of the tie) is always accepted, the
    # sampled draft only when it drew 3
    sure = [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    point, sampled = history_bounds.count_draft_acceptance(
        [1, 2, 3, 1, 2, 4], [[1, 2, 3]], [[uniform, uniform, sure]]
    )
    assert point[2] == pytest.approx(1.0) and sampled[2] == pytest.approx(0.5)


def _seed(seed: int, spot: float, base: float, mix: float, rel_se: float) -> dict:
    def row(run: str, speedup: float) -> dict:
        return {
            "run": run,
            "rollout_speedup": speedup,
            "rollout_s_rel_se": rel_se,
            "accept_len_per_step": [2.5],
        }

    table = [row("nospec", 1.0), row("tlt-spot", spot), row("tltbase", base), row("tlt-mix", mix)]
    return {"seed": seed, "table": table, "history_ceiling_step0": 3.0}


@pytest.mark.parametrize(
    "mixes, rel_se, is_met",
    [
        ((1.50, 1.45, 1.40), 0.02, True),  # 0 to 0.05 below, se ~0.04: within noise
        ((1.30, 1.25, 1.20), 0.02, False),  # 0.2 below, se ~0.04: below the better drafter
        ((1.30, 1.25, 1.20), 0.10, True),  # the same gap in runs five times as noisy
        ((1.60, 1.50, 1.20), 0.0, True),  # at or above the better one on two of three seeds
    ],
)
def test_the_mix_check_pairs_each_seed_with_its_better_single_drafter(mixes, rel_se, is_met):
    per_seed = [
        _seed(1, spot=1.50, base=1.10, mix=mixes[0], rel_se=rel_se),
        _seed(2, spot=1.40, base=1.45, mix=mixes[1], rel_se=rel_se),  # history the better here
        _seed(3, spot=1.45, base=1.00, mix=mixes[2], rel_se=rel_se),
    ]
    checks = grpo_checks.mix_check(per_seed)
    assert [p["better_alone"] for p in checks["mix_minus_better_alone"]] == [
        "tlt-spot",
        "tltbase",
        "tlt-spot",
    ]
    assert checks["mix_minus_better_alone"][1]["diff"] == pytest.approx(mixes[1] - 1.45)
    assert checks["mix_ge_better_alone_within_noise"] is is_met


@pytest.mark.parametrize(
    "step0, is_met",
    [(2.1, True), (1.9, False), (None, False)],  # None: no SD at step 0
)
def test_the_history_accept_check_reads_step_0_and_fails_without_sd(step0, is_met, capsys):
    summary = [{"run": "tltbase", "accept_len_step0_median": step0}]
    checks = grpo_checks.history_accept_check(summary, [_seed(1, 1.5, 1.2, 1.4, 0.02)])
    assert checks == {"history_accept_len_step0_ge_2": is_met}
    printed = capsys.readouterr().out
    assert ("no SD iteration at step 0" in printed) is (step0 is None)
    assert ("NOT met" in printed) is not is_met


def test_the_history_accept_check_says_how_many_seeds_ran_sd_at_step_0(capsys):
    summary = [{"run": "tltbase", "accept_len_step0_median": 2.3, "accept_len_step0_num_seeds": 2}]
    per_seed = [_seed(s, 1.5, 1.2, 1.4, 0.02) for s in (1, 2, 3)]
    assert grpo_checks.history_accept_check(summary, per_seed)["history_accept_len_step0_ge_2"]
    assert "over the 2 of 3 seeds whose step 0 ran SD" in capsys.readouterr().out


def test_a_step_without_sd_is_no_step_0_accept_length():
    from tltrun.train.compare import compare_runs

    def res(accepts: list[float]) -> dict:
        log = [
            {"rollout_s": 1.0, "step_s": 1.0, "response_tokens_mean": 1.0, "accept_len": a}
            | {"reward_mean": 0.0, "drafter_train_s": 0.0, "idle_worker_s": 0.0}
            for a in accepts
        ]
        return {"config": {"prompts_per_step": 1, "group_size": 1}, "log": log}

    # the step log's 0.0 means no SD iteration ran in that step
    table = compare_runs({"nospec": res([0.0, 0.0]), "tltbase": res([0.0, 2.4])})
    assert table[1]["accept_len_per_step"] == [None, 2.4]
    assert grpo_checks.table_row(table, "tltbase") is None
    table = compare_runs({"nospec": res([0.0, 0.0]), "tltbase": res([2.2, 2.4])})
    assert grpo_checks.table_row(table, "tltbase") == 2.2


def _seed_tables(seed: int, nospec: list[float], tlt: list[float]) -> dict:
    return {
        "seed": seed,
        "table": [
            {"run": "nospec", "reward_per_step": nospec},
            {"run": "tlt-spot", "reward_per_step": tlt},
        ],
    }


def test_reward_curves_that_differ_by_noise_pass_and_a_shifted_curve_fails():
    rng = random.Random(0)
    curve = [0.5 + 0.02 * t for t in range(20)]  # both runs learn at the same rate

    def noisy(shift: float) -> list[float]:
        return [c + shift + rng.gauss(0.0, 0.1) for c in curve]

    same = [_seed_tables(s, noisy(0.0), noisy(0.0)) for s in (1, 2, 3)]
    checks = grpo_checks.reward_checks(("nospec", "tlt-spot"), same)
    assert set(checks) == {"tlt-spot"} and checks["tlt-spot"]["within_noise"]
    assert len(checks["tlt-spot"]["per_seed"]) == 3
    shifted = [_seed_tables(s, noisy(0.0), noisy(-0.3)) for s in (1, 2, 3)]
    checks = grpo_checks.reward_checks(("nospec", "tlt-spot"), shifted)
    assert not checks["tlt-spot"]["within_noise"]
    assert checks["tlt-spot"]["median_diff"] == pytest.approx(-0.3, abs=0.1)


def test_the_cost_benchmark_runs_and_writes_its_tables(tmp_path):
    """benchmarks/bench_history.py's cost tables at toy sizes: every table printed and in the
    JSON (the timings themselves are the benchmark's to report, not a test's)."""
    import json
    import subprocess

    out = tmp_path / "h.json"
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "bench_history.py"
    args = ["--sizes", "500", "--loop-sizes", "300", "--steady-steps", "2", "--repeats", "1"]
    result = subprocess.run(
        [sys.executable, str(script), *args, "--steady-prompts", "2", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    tables = json.loads(out.read_text())
    assert [(r["history_tokens"], r["is_cross_prompt"]) for r in tables["proposal_cost"]] == [
        (500, False),
        (500, True),
    ]
    assert [(r["cycle_tokens"], r["max_draft_tokens"]) for r in tables["loop_cost"]] == [
        (1, 64),
        (1, 10**9),
        (3, 64),
        (3, 10**9),
    ]
    assert [r["evict_to_fraction"] for r in tables["steady_state"]] == [1.0, 0.9]
    assert "unbounded" in result.stdout and "step s at the cap" in result.stdout

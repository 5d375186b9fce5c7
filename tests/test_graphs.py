"""The rollout engine's CUDA-graph pool (issue #18): the capture plan follows the policy (every
decision it can make at a captured batch size has a graph, no graph is one it can never use),
bucket choice, and padding — the padded static forwards (what a graph replays) give the real
rows exactly the eager forward's logits and KV entries, on CPU. The flex_attention path (each
sequence attends to its own length) equals the dense SDPA reference. The capture itself runs
on CUDA only (marked ``gpu``).

Run: ``python -m pytest tests/test_graphs.py -q``.
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import VOCAB, tiny_model

from tltrun.model.drafter import tree_layout
from tltrun.model.kvcache import KVCache
from tltrun.rollout.graphs import (
    VLLM_BATCH_BUCKETS,
    CapturePlan,
    GraphPool,
    batch_buckets,
    bucket_for,
    capture_plan,
)
from tltsim.errors import UsageError
from tltsim.policy import NoSpec, StaticSpec, TLTAdaptive, TLTBase, bucket_arms

MODEL = tiny_model(seed=3)
CFG = MODEL.config


# ---------------------------------------------------------------------------------------------
# Plan and buckets (plain Python)
# ---------------------------------------------------------------------------------------------


def test_buckets_are_vllms_capture_sizes_capped_at_the_engine_size():
    assert VLLM_BATCH_BUCKETS[:5] == (1, 2, 4, 8, 16) and VLLM_BATCH_BUCKETS[-1] == 256
    assert batch_buckets(256) == VLLM_BATCH_BUCKETS
    assert batch_buckets(100)[-3:] == (88, 96, 100)
    assert batch_buckets(1) == (1,) and batch_buckets(3) == (1, 2, 3)
    assert bucket_for(3, (1, 2, 4, 8)) == 4 and bucket_for(8, (1, 2, 4, 8)) == 8
    assert bucket_for(9, (1, 2, 4, 8)) is None
    with pytest.raises(ValueError):
        batch_buckets(0)


def test_tlt_default_plan():
    # TLT's defaults: threshold 32; buckets from 1, 2, 5, 21 with 8_4_48, 8_4_32, 8_4_16, 8_4_8
    plan = capture_plan(TLTAdaptive(), 256)
    assert plan.decode_buckets == tuple(b for b in VLLM_BATCH_BUCKETS if b > 32)
    assert plan.spec_graphs == (
        (1, "8_4_48"),
        (2, "8_4_32"),
        (4, "8_4_32"),  # batches 3..4
        (8, "8_4_16"),  # 5..8
        (16, "8_4_16"),  # 9..16
        (24, "8_4_16"),  # 17..20 ...
        (24, "8_4_8"),  # ... and 21..24: two policy buckets meet in one graph bucket
        (32, "8_4_8"),
    )
    assert plan.num_graphs == 28 + 8
    assert plan.decode_bucket(20) == 40  # a warm-up iteration pads up to the first decode graph
    assert plan.spec_bucket(3, "8_4_32") == 4 and plan.spec_bucket(3, "8_4_48") is None


@pytest.mark.parametrize(
    "policy",
    [
        TLTAdaptive(),
        TLTAdaptive(threshold=12, bucket_starts=(1, 7), strategies=("6_2_10", "4_1_4", "5_2_4")),
        TLTAdaptive(drafters=("eagle", "history")),
        TLTAdaptive(drafters=("eagle", "history"), history_strategies=("8_1_8", "2_1_2")),
        TLTBase(),
    ],
)
@pytest.mark.parametrize("max_batch", [1, 5, 40, 256])
def test_tlt_plan_covers_every_choice_and_nothing_else(policy, max_batch):
    plan = capture_plan(policy, max_batch)
    cfg, buckets = policy.config, policy.config.buckets()
    # every batch the policy may speculate at (<= threshold) has a graph for each of its arms
    for batch in range(1, min(cfg.threshold, max_batch) + 1):
        for arm in bucket_arms(buckets, batch):
            assert plan.spec_bucket(batch, arm.strategy) is not None, (batch, arm)
    for batch in range(cfg.threshold + 1, max_batch + 1):
        assert plan.decode_bucket(batch) is not None
    # every graph serves some batch the policy can run it at
    graph_buckets = batch_buckets(max_batch)
    for b, strategy in plan.spec_graphs:
        lo = max((x for x in graph_buckets if x < b), default=0) + 1
        assert any(
            strategy in {a.strategy for a in bucket_arms(buckets, n)}
            for n in range(lo, min(b, cfg.threshold) + 1)
        ), (b, strategy)
    assert all(b > cfg.threshold for b in plan.decode_buckets)
    assert len(set(plan.spec_graphs)) == len(plan.spec_graphs)


def test_fixed_policies_capture_only_what_they_run():
    assert capture_plan(NoSpec(), 20) == CapturePlan(decode_buckets=(1, 2, 4, 8, 16, 20))
    plan = capture_plan(StaticSpec(strategy="4_2_8"), 6)
    assert plan.decode_buckets == () and plan.spec_graphs == (
        (1, "4_2_8"),
        (2, "4_2_8"),
        (4, "4_2_8"),
        (6, "4_2_8"),
    )
    assert plan.only(("x",)).spec_graphs == () and plan.strategies == ("4_2_8",)


def test_deterministic_modes_wrapper_plans_as_the_policy_it_wraps():
    """--deterministic wraps the policy (ModelledFeedback): its plan had decode graphs only,
    so a deterministic CUDA run verified every SD iteration eagerly."""
    from tltrun.train.spot import ModelledFeedback

    for policy in (TLTAdaptive(), StaticSpec(strategy="4_2_8")):
        assert capture_plan(ModelledFeedback(policy), 40, is_drafting=True) == capture_plan(
            policy, 40, is_drafting=True
        )


# ---------------------------------------------------------------------------------------------
# Padding: the static forward a graph replays, run eagerly on CPU
# ---------------------------------------------------------------------------------------------


def _filled_cache(lens: list[int], num_slots: int, seed: int) -> KVCache:
    """A cache whose first len(lens) slots hold random committed contexts; the other (free)
    slots hold garbage and a stale length, as after a release."""
    gen = torch.Generator().manual_seed(seed)
    cache = KVCache.for_model(CFG, num_slots, 64)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    cache.lens.copy_(torch.randint(1, 40, (num_slots,), generator=gen))
    cache.lens[: len(lens)] = torch.tensor(lens)
    return cache


def _random_tree(batch: int, num_nodes: int, seed: int) -> torch.Tensor:
    """(B,N+1) parents: node i's parent is any earlier node (the root 0 is its own)."""
    gen = torch.Generator().manual_seed(seed)
    parents = torch.zeros(batch, num_nodes, dtype=torch.long)
    for i in range(1, num_nodes):
        parents[:, i] = torch.randint(0, i, (batch,), generator=gen)
    return parents


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("num_real,bucket", [(1, 1), (1, 4), (3, 4), (5, 8)])
def test_padded_decode_and_verify_equal_the_eager_forward(impl, num_real, bucket):
    lens = [7, 30, 1, 22, 13][:num_real]
    gen = torch.Generator().manual_seed(num_real)
    strategy = "3_2_5"
    plan = CapturePlan(decode_buckets=(bucket,), spec_graphs=((bucket, strategy),))
    slots = torch.arange(num_real)
    for num_nodes in (1, 6):
        ids = torch.randint(0, VOCAB, (num_real, num_nodes), generator=gen)
        if num_nodes == 1:
            depth, tree_mask = torch.zeros(num_real, 1, dtype=torch.long), None
        else:
            depth, tree_mask = tree_layout(_random_tree(num_real, num_nodes, seed=num_real), 3)
        ref_cache = _filled_cache(lens, bucket, seed=1)
        ctx = ref_cache.context(slots, num_nodes, tree_mask=tree_mask, impl="sdpa")
        with torch.no_grad():
            want_logits, want_hidden = MODEL(ids, ref_cache.lens[slots, None] + depth, ctx)
        cache = _filled_cache(lens, bucket, seed=1)
        pool = GraphPool(MODEL, cache, plan, impl, is_capturing=False)
        fwd = (
            pool.decode_forward(num_real)
            if num_nodes == 1
            else pool.verify_forward(num_real, strategy)
        )
        assert fwd.batch == bucket
        with torch.no_grad():
            logits, hidden = fwd(ids, depth, tree_mask)
        assert logits.shape == want_logits.shape
        torch.testing.assert_close(logits, want_logits, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(hidden, want_hidden, atol=1e-5, rtol=1e-5)
        # the real rows' new KV entries, and nothing else of theirs, changed as eagerly
        for s, n in enumerate(lens):
            width = n + num_nodes
            torch.testing.assert_close(
                cache.k[:, s, :, :width], ref_cache.k[:, s, :, :width], atol=1e-5, rtol=1e-5
            )
            assert torch.equal(cache.k[:, s, :, width:], ref_cache.k[:, s, :, width:])
        assert torch.equal(cache.lens[:num_real], ref_cache.lens[:num_real])  # no commit
        assert bool((cache.lens[num_real:bucket] == 0).all())  # padding rows: free, emptied


# ---------------------------------------------------------------------------------------------
# Unpadded attention: flex_attention by per-sequence lengths == the dense SDPA reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", ["prefill", "decode", "tree"])
def test_flex_attention_equals_dense_sdpa(case):
    lens = [0, 5, 37, 2] if case == "prefill" else [3, 40, 17, 150]
    gen = torch.Generator().manual_seed(11)
    slots = torch.tensor([0, 2, 1, 3])  # not a contiguous range: the gathered path too
    num_new, tree_mask, depth = None, None, None
    if case == "prefill":
        t = 9
        num_new = torch.tensor([9, 4, 1, 6])
    elif case == "decode":
        t = 1
    else:
        t = 7
        depth, tree_mask = tree_layout(_random_tree(4, t, seed=2), 4)
    ids = torch.randint(0, VOCAB, (4, t), generator=gen)
    positions = None
    outs = {}
    for impl in ("sdpa", "flex"):
        cache = KVCache.for_model(CFG, 4, 200)
        cache.k.copy_(torch.randn(cache.k.shape, generator=torch.Generator().manual_seed(5)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=torch.Generator().manual_seed(6)))
        cache.lens[slots] = torch.tensor(lens)
        base = cache.lens[slots, None]
        positions = base + (torch.arange(t)[None] if depth is None else depth)
        ctx = cache.context(slots, t, tree_mask=tree_mask, num_new=num_new, impl=impl)
        with torch.no_grad():
            outs[impl] = (*MODEL(ids, positions, ctx), cache.k.clone())
    valid = (
        torch.ones(4, t, dtype=torch.bool)
        if num_new is None
        else (torch.arange(t)[None] < num_new[:, None])
    )
    for want, got in zip(outs["sdpa"], outs["flex"], strict=True):
        if want.dim() == 3:  # logits, hidden: padded prefill positions are garbage in both
            want, got = want[valid], got[valid]
        err = (want - got).abs()
        print(f"{case}: max err {float(err.max()):.2e}, mean {float(err.mean()):.2e}")
        torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# CUDA capture (GPU only)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture is CUDA-only")
@pytest.mark.parametrize("impl", ["sdpa", "flex"])
def test_captured_graphs_replay_the_eager_forward(impl):
    model = tiny_model(seed=3).to("cuda")
    lens = [7, 30, 1]
    plan = CapturePlan(decode_buckets=(4,), spec_graphs=((4, "3_2_5"),))
    ids = torch.randint(0, VOCAB, (3, 1), device="cuda")
    eager_cache = _filled_cache(lens, 4, seed=1)
    eager_cache.k, eager_cache.v, eager_cache.lens = (
        eager_cache.k.cuda(),
        eager_cache.v.cuda(),
        eager_cache.lens.cuda(),
    )
    graph_cache = KVCache.for_model(CFG, 4, 64, device="cuda")
    graph_pool = GraphPool(model, graph_cache, plan, impl, is_capturing=True)
    assert graph_pool.captured_bytes >= 0 and all(
        f.graph is not None for f in graph_pool.decode.values()
    )
    graph_cache.k.copy_(eager_cache.k)
    graph_cache.v.copy_(eager_cache.v)
    graph_cache.lens.copy_(eager_cache.lens)
    eager = GraphPool(model, eager_cache, plan, impl, is_capturing=False)
    with torch.no_grad():
        want, _ = eager.decode_forward(3)(ids)
        want = want.clone()
        got, _ = graph_pool.decode_forward(3)(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # weights updated in place: the graph reads the new values at replay
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
        graph_cache.lens.copy_(eager_cache.lens)
        again, _ = graph_pool.decode_forward(3)(ids)
        eager_cache.lens[:3] = torch.tensor(lens, device="cuda")
        fresh, _ = eager.decode_forward(3)(ids)
    torch.testing.assert_close(again, fresh, atol=1e-4, rtol=1e-4)


def test_profiles_of_the_flex_engine_say_its_attention_is_not_padded():
    from tltrun.profile.torch_engine import attention_context

    assert attention_context("flex", "cuda") == attention_context(None, "cuda") == "summed"
    # eager flex off CUDA scores the whole slot width: a mixed batch costs batch x the longest
    # context (it was labelled summed, and the simulator priced such batches ~8x too cheap)
    assert attention_context("flex", "cpu") == "padded"
    assert attention_context("sdpa", "cpu") == attention_context("triton", "cpu") == "padded"
    assert attention_context(None, "cpu") == "padded"  # the CPU default: dense SDPA


def load_gpu_bench(monkeypatch):
    """benchmarks/bench_gpu_engine.py as a module (benchmarks/ is not a package)."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "bench_gpu_engine.py"
    spec = importlib.util.spec_from_file_location("bench_gpu_engine", path)
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_gpu_engine", bench)  # dataclasses look it up
    spec.loader.exec_module(bench)
    return bench


def test_gpu_benchmark_script_runs_its_smoke_mode_on_cpu(tmp_path, capsys, monkeypatch):
    import json

    bench = load_gpu_bench(monkeypatch)
    assert bench.main(["--device", "cpu"]) == 0  # CPU without --smoke: measures nothing
    assert "only --smoke" in capsys.readouterr().out
    assert bench.main(["--device", "cpu", "--smoke", "--out_dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    result = json.loads((tmp_path / "bench_gpu_engine.json").read_text())
    assert {"decode", "sd", "pool", "hf", "copy_bytes_per_s"} <= set(result)
    assert all(
        r["eager_tokens_per_s"] > 0 and r["graphs_tokens_per_s"] > 0 for r in result["decode"]
    )
    # the compiled-layers engine at the roofline target's cell (batch 1, first context) only
    compiled = [(r["batch"], r["context"]) for r in result["decode"] if "compiled_speedup" in r]
    assert compiled == [(1, 32)]
    for mode in ("fused", "compiled_fused"):  # and the fused engines, each on its own model copy
        fused = [(r["batch"], r["context"]) for r in result["decode"] if f"{mode}_speedup" in r]
        assert fused == [(1, 32)]
    assert [r["batch"] for r in result["sd"]] == [1, 2, 1, 2]
    where = {(r["mode"], r["batch"]): r for r in result["where"]}  # decode steps, profiled
    modes_at_1 = {("graphs", 1), ("compiled", 1), ("compiled_fused", 1), ("eager", 1)}
    assert set(where) == modes_at_1 | {("graphs", 4)}  # the smoke grid's largest batch
    for row in where.values():
        assert row["busy_ms"] > 0 and row["kernels_per_step"] > 0 and row["gemm_ms"] > 0
        assert row["top_kernels"][0]["ms_per_step"] >= row["top_kernels"][-1]["ms_per_step"]
    assert "costliest kernels per decode step" in out
    assert (
        "graphs/eager" in out
        and "compiled/graphs" in out
        and json.loads((tmp_path / "config.json").read_text())["is_smoke"]
    )
    # a later call re-measures only the sections it names
    part = tmp_path / "part"
    argv = ["--device", "cpu", "--smoke", "--out_dir", str(part), "--sections", "pool,sd"]
    assert bench.main(argv) == 0
    out = capsys.readouterr().out
    result = json.loads((part / "bench_gpu_engine.json").read_text())
    assert {"sd", "pool"} <= set(result) and not {"decode", "where", "hf"} & set(result)
    assert out.index("\npool (") < out.index("\nsd (")  # in the order asked
    assert [r["batch"] for r in result["sd"]] == [1, 2, 1, 2]
    with pytest.raises(SystemExit):
        bench.main(["--device", "cpu", "--smoke", "--sections", "sd,roofline"])
    assert "unknown ['roofline']" in capsys.readouterr().err


def test_a_gpu_benchmark_run_with_failed_cells_exits_1(tmp_path, capsys, monkeypatch):
    """Every section failing at capture (session 13) exited 0, and gpu_session.sh, which judges
    steps by exit code, said they ended well."""
    bench = load_gpu_bench(monkeypatch)

    def broken(*args, **kwargs):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(bench, "bench_sd", broken)
    argv = ["--device", "cpu", "--smoke", "--out_dir", str(tmp_path), "--sections", "sd"]
    assert bench.main(argv) == 1
    captured = capsys.readouterr()
    assert "error: RuntimeError: capture failed" in captured.out
    assert "failed cells: 1" in captured.err
    assert (tmp_path / "bench_gpu_engine.json").is_file()  # what did run is still written


def test_an_interrupted_gpu_benchmark_writes_the_cells_it_measured(tmp_path, capsys, monkeypatch):
    """gpu_session.sh stops a step at its limit with SIGINT: the JSON was written only after
    every section, so a run cut inside its one section lost every figure it had measured."""
    import json

    bench = load_gpu_bench(monkeypatch)
    measured = bench.time_cell
    calls = []

    def interrupted_at_the_second_cell(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return measured(*args, **kwargs)

    monkeypatch.setattr(bench, "time_cell", interrupted_at_the_second_cell)
    argv = ["--device", "cpu", "--smoke", "--out_dir", str(tmp_path), "--sections", "decode,sd"]
    assert bench.main(argv) == 1
    result = json.loads((tmp_path / "bench_gpu_engine.json").read_text())
    first, cut = result["decode"]
    assert first["batch"] == 1 and first["graphs_tokens_per_s"] > 0
    assert cut == {"note": "error: interrupted (the step's time limit)"}
    assert result["sd"] == [{"note": "skipped: interrupted"}] and len(calls) == 2
    assert "failed cells: 1" in capsys.readouterr().err


def test_gpu_benchmark_sorts_kernel_names_by_kind(monkeypatch):
    load_gpu_bench(monkeypatch)  # puts benchmarks/ on sys.path
    import gpu_engine_where

    kind = gpu_engine_where.kernel_kind
    assert kind("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64") == "gemm"
    assert kind("void gemv2T_kernel_val<int, int, __nv_bfloat16, float, 128, 16>") == "gemm"
    assert kind("nvjet_sm90_tst_192x8_64x8_4x1_v_bz_NNT") == "gemm"  # H200, cu130 cuBLAS
    assert kind("triton_tem_fused_flex_attention_0") == "attention"
    assert kind("void flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>") == "attention"
    assert kind("fmha_cutlassF_bf16_aligned_64x64_rf_sm80") == "attention"  # not a GEMM
    assert kind("void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>") == "other"
    assert kind("aten::linear") == kind("aten::mm") == "gemm"
    assert kind("aten::rms_norm") == "other"


def test_eager_flag_turns_the_pool_off():
    import argparse

    from tltrun.cli.args import add_engine_args, engine_config_from_args

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    base = ["--max-running-requests", "2", "--max-model-len", "8"]
    assert engine_config_from_args(parser.parse_args(base)).cuda_graphs is None  # device default
    assert engine_config_from_args(parser.parse_args([*base, "--eager"])).cuda_graphs is False
    # where no pool runs (CPU, --eager) the sizes are refused (they were accepted and ignored)
    sizes = ["--graph-batch-sizes", "1,2"]
    with pytest.raises(UsageError, match="--graph-batch-sizes: no CUDA-graph pool runs here"):
        engine_config_from_args(parser.parse_args([*base, *sizes, "--device", "cpu"]))
    with pytest.raises(UsageError, match=", --eager\\); drop it"):
        engine_config_from_args(parser.parse_args([*base, *sizes, "--eager"]))
    if torch.cuda.is_available():
        cfg = engine_config_from_args(parser.parse_args([*base, *sizes, "--device", "cuda"]))
        assert cfg.graph_batch_sizes == (1, 2)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the GPU engine defaults")
def test_cuda_engine_defaults_and_lossless_sd_with_graphs():
    from tltrun.model.drafter import EagleDrafter
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import Request, SamplingParams

    reqs = [Request(f"r{i}", tuple(range(5, 5 + 3 * i + 1)), 12) for i in range(5)]

    def run(policy, **fields):
        model = tiny_model(seed=3)
        drafter = EagleDrafter.for_target(model, seed=1)
        cfg = EngineConfig(
            max_running_requests=4, max_model_len=64, sampling=SamplingParams(0.0),
            device="cuda", **fields,
        )  # fmt: skip
        eng = RolloutEngine(model, drafter, cfg)
        return eng, [o.output_token_ids for o in eng.generate(reqs, policy).outputs]

    eng, _ = run(NoSpec())
    assert (
        eng.cache.k.dtype == torch.bfloat16
        and eng.graphs is not None
        and eng.graphs.pool is not None
    )
    # float32 on CUDA: greedy SD through the captured verify graphs equals plain greedy decoding
    _, want = run(NoSpec(), dtype="float32", cuda_graphs=False)
    for policy in (NoSpec(), StaticSpec(strategy="3_2_6"), StaticSpec(strategy="4_1_4")):
        _, got = run(policy, dtype="float32")
        assert got == want, policy
    # stacked projections: SD through the graphs equals the same engine's plain greedy (the
    # stacked GEMMs' own rounding on both sides; CPU tests compare stacked with apart)
    _, want = run(NoSpec(), dtype="float32", cuda_graphs=False, fuse_projections=True)
    _, got = run(StaticSpec(strategy="3_2_6"), dtype="float32", fuse_projections=True)
    assert got == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: graph capture is CUDA-only")
def test_capturing_the_pool_leaves_the_sampling_generator_as_it_was():
    """Each capture's warm-up draws from the engine's generator: a run resumed from a
    checkpoint (capturing at its first rollout) drew other numbers from then on than the
    uninterrupted run, which captured at step 0 (review of the CUDA-only paths)."""
    from tltrun.model.drafter import EagleDrafter
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import SamplingParams

    model = tiny_model(seed=3)
    cfg = EngineConfig(max_running_requests=4, max_model_len=64, sampling=SamplingParams(1.0),
                       device="cuda")  # fmt: skip
    eng = RolloutEngine(model, EagleDrafter.for_target(model, seed=1), cfg)
    before = eng.generator.get_state()
    eng.prepare_graphs([NoSpec(), StaticSpec(strategy="3_1_3")])
    assert eng.graphs is not None and eng.graphs.pool is not None
    assert torch.equal(eng.generator.get_state(), before)

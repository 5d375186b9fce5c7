"""Published engine-level step latencies: the data the shipped GPU calibrations are fitted to.

Every number here is copied from its source, cited beside it, and tagged with how it was
obtained. ``CalibratedCost``'s H100 parameters (``tltsim.cost.calibrated.CALIBRATIONS``) are
fitted to the points with ``use="fit"`` and checked on those with ``use="held_out"``
(``benchmarks/bench_costmodel.py``). Only step latencies are used: SD speedup figures of any
paper are validation data, never fit data (issue #21).

    from tltsim.cost.published import published_points, as_profile_rows
    fit = [p for p in published_points() if p.use == "fit"]

What was found, honestly (searches of the docs/pages/code/issues corpora, Nov 2026):

* SpecDecode-Bench (Liu et al., "Speculative Decoding: Performance or Illusion?",
  arXiv 2601.11580) publishes a step-time model of vLLM serving Llama-3.1-8B-Instruct on H100,
  fitted by its authors to their own step measurements at batch sizes 1, 8, 16, 32, 64
  (github.com/SpecDecode-Bench/simulator, predictor.py, class ``Llama8BH100``, comment "fitted
  with instructcoder bs=1,8,16,32,64"; simulator.py adds ``overhead_constant_per_step`` to every
  forward). Their raw points are not published, so the points below are that model EVALUATED
  inside its fitted batch range (``kind="published_fit"``): they carry the authors' fit error,
  which is not reported. Contexts 512 and 2048 tokens per sequence are our choice; the
  InstructCoder contexts they fitted on are not reported either. The same file's EAGLE
  drafting-time model (``draft_c_*``) gives ``drafter`` points the same way (one draft step of a
  3-token proposal each): what ``draft_step_overhead_s`` is fitted on.
* SGLang's EAGLE announcement (github.com/SafeAILab/EAGLE pull request #173, 2025-01-02):
  "Normal decoding speed (SGLang): 156 token/s" for Llama-2-7b-chat-hf on a single H100, one
  request (``kind="measured"``). 1/156 s per decode step includes the prefill amortised over
  the answer; the prompt is one short sentence and the answer length is not reported, so the
  context per sequence (256) is our assumption. A different engine and model: the held-out test
  of leaving a whole source out.
* SGLang's speculative-decoding documentation, "Performance Highlights" table
  (docs.sglang.io/advanced_features/speculative_decoding.html): "SGLang (w/o speculative,
  1x H100) 158.34 tokens/s" for LLaMA-Instruct 3.1 8B on MT-bench (``kind="measured"``, held
  out). As above, one request at a time, prefill amortised; context per sequence (512, an
  MT-bench turn plus its answer) is our assumption.
* Validation only (never fitted), in ``tltsim.cost.published_sd``: SD speedup vs batch size,
  each series with its published strategy (``SD_BATCH_SERIES``): EAGLE-3 paper Table 3 (SGLang,
  chain of 3, batch 2-64) and SpecDecode-Bench Figs. 1 (vLLM, Llama-3.1-8B, chain k=3) and 2
  (SGLang, Qwen3-8B, chain k=3, trees k=6 / k=21), batch 1-128. EAGLE-3's batch-1 2.36x (373.25 / 158.34 tokens/s, its Table 4
  = the SGLang docs' table) states no strategy and is another configuration: not used; its
  baseline, 158.34 tokens/s, is a batch-1 step latency (above).
* Independent held-out data, never fitted (``independent_points``, ``StaticBatchPoint``; brief F
  of issue #21): static-batch benchmarks (output tokens/s of ``batch`` requests decoded together,
  prefill included) of Llama-2-7B on A100 FP16 from LMDeploy's TurboMind (v0.1.0a1, all 20
  llama2-7b rows of docs/en/benchmark/a100_fp16.md) and of LLaMA-7B from TensorRT-LLM 0.5.0's
  A100 FP16 table (docs/source/performance.md). Other engines, sources and GPU than the fit: an
  A100 result is a transfer test of the H100 calibration's fractions, not a calibration.
* A second model on the same GPU (found Nov 26, 2026): adixg/vllm-specdecode-cost-model's H100
  measurements of vLLM 0.28 serving Qwen3-1.7B (bf16, FlashAttention 3, full CUDA graphs): the
  model forward's GPU time (CUDA events; no LM head, sampling or host work) of 1-64 one-token
  requests on 0-8,192 tokens of context each, 77 cells from its results JSON, plus 6 cells to
  32,000 tokens printed in its FINDINGS.md (``kind="measured"``). Twelve cells (batches 1, 8, 32,
  64 at contexts 0, 1,024, 4,096) are fitted with SpecDecode-Bench's points; the other 71 are
  held out. A thinner, 28-layer model separates the per-layer fixed cost from weight streaming,
  which one model cannot (``tltsim.cost.calibrate``).
* Not found (searched: docs/pages/issues/code corpora, Nov 2026): H100 or H200 BF16 step latency or
  throughput at several batch sizes for a 7-8B model whose numbers we could read as text
  (TensorRT-LLM's H100 rows are FP8; vLLM's and SGLang's batch scans are figures or dashboards),
  TP all-reduce timings, measured per-draft-step timings (SpecDecode-Bench's fitted drafting
  model above is the only drafter timing used), and accept lengths for most SD-vs-batch series
  (only SpecDecode-Bench's Qwen3-8B/GSM8K chain and k=21 tree print one). H200 and A100 presets
  therefore stay on the roofline.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tltsim.cost.profile import ProfileRow
from tltsim.cost.specs import ModelSpec, get_model

SPECDECODE_BENCH = (
    "SpecDecode-Bench, arXiv 2601.11580; github.com/SpecDecode-Bench/simulator predictor.py "
    "class Llama8BH100 (fitted with instructcoder bs=1,8,16,32,64)"
)
SGLANG_DOCS = (
    "docs.sglang.io/advanced_features/speculative_decoding.html, Performance Highlights: "
    "'SGLang (w/o speculative, 1x H100) 158.34 tokens/s', LLaMA-Instruct 3.1 8B, MT-bench"
)
SGLANG_EAGLE = (
    "github.com/SafeAILab/EAGLE pull request #173 (SGLang EAGLE announcement, 2025-01-02): "
    "'Normal decoding speed (SGLang): 156 token/s', Llama-2-7b-chat-hf, single H100"
)

# SpecDecode-Bench predictor.py, class Llama8BH100 (seconds; kv and batched tokens are counts):
# forward = c_kv x tokens in the KV cache + c_compute x batched tokens + c_fixed, and every
# step adds overhead_constant_per_step (simulator.py).
SDB_C_KV_S = 3.92645679e-08
SDB_C_COMPUTE_S = 2.10103129e-05
SDB_C_FIXED_S = 5.88590713e-03
SDB_OVERHEAD_PER_STEP_S = 1.20683946e-03

# The same file's EAGLE drafting time, one proposal (all draft steps of an iteration):
# draft = c_kv x tokens in the whole batch's KV cache + c_spec x input length + c_fixed, where
# the input length is one request's proposed tokens + 1 (simulator.py predict_draft_time; the
# step overhead above is added separately). simulator.py uses it only for the EAGLE acceptance
# data (get_propose_method: ProposeMethod.EAGLE for AccLenGroundTruth.EAGLE; EAGLE-3 runs fall
# back to the n-gram branch), so it is the EAGLE-1 drafter: one decoder layer and the target's
# full 128k-token LM head, our DrafterSpec default.
SDB_DRAFT_C_KV_S = 2.37768493e-09
SDB_DRAFT_C_SPEC_S = 8.41429603e-07
SDB_DRAFT_C_FIXED_S = 2.13526175e-03
# Draft tokens per proposal: the paper's setting ("3 draft tokens per step", its Fig. 1; the
# predictor's FIXED_3 input length 4). The fitted range does not say which k it saw; a
# proposal of k tokens is k drafter forwards in vLLM's EAGLE proposer, so each point below is
# one k-th of a proposal (our ``drafter`` row: one draft step).
SDB_DRAFT_TOKENS = 3

# huggingface.co/meta-llama/Llama-2-7b-chat-hf/blob/main/config.json: 32 layers, hidden 4096,
# intermediate 11008, 32 attention and 32 KV heads (no GQA), vocab 32000, untied LM head.
LLAMA2_7B = ModelSpec(
    "Llama-2-7B",
    num_layers=32,
    hidden_size=4096,
    intermediate_size=11008,
    num_attention_heads=32,
    num_kv_heads=32,
    head_dim=128,
    vocab_size=32000,
)


@dataclass(frozen=True, kw_only=True)
class PublishedPoint:
    """One engine iteration's seconds at (batch, context, tokens per sequence), with its source."""

    source: str  # citation: paper / repository, file or table
    kind: str  # "measured" (a reported number) or "published_fit" (a published model evaluated)
    use: str  # "fit" or "held_out"
    hardware: str  # tltsim.cost.specs hardware preset
    model: ModelSpec
    engine: str
    op: str  # decode or verify (a whole engine iteration), forward (the layers alone, GPU time),
    # drafter (one draft step of an EAGLE proposal)
    batch: int
    context_tokens: int  # KV tokens over the batch before the forward
    tokens_per_seq: int  # 1 for decode, verify tokens + 1 (the root) for verify
    seconds: float

    def __post_init__(self) -> None:
        if self.kind not in ("measured", "published_fit") or self.use not in ("fit", "held_out"):
            raise ValueError(f"PublishedPoint: bad kind {self.kind!r} or use {self.use!r}")


def _specdecode_bench_points() -> list[PublishedPoint]:
    """SpecDecode-Bench's model at its fitted batch sizes. Held out: batches 8 and 32 and the
    7-token verify (6 draft tokens + root), so the fit sees batches 1, 16, 64 and 1 or 4 new
    tokens per sequence, and must interpolate in batch and extrapolate in verify tokens."""
    points = []
    model = get_model("Llama-3.1-8B")
    for batch in (1, 8, 16, 32, 64):
        for context_per_seq in (512, 2048):
            for tokens in (1, 4, 7):
                context = batch * context_per_seq
                seconds = (
                    SDB_C_KV_S * context
                    + SDB_C_COMPUTE_S * batch * tokens
                    + SDB_C_FIXED_S
                    + SDB_OVERHEAD_PER_STEP_S
                )
                is_held_out = batch in (8, 32) or tokens == 7
                points.append(
                    PublishedPoint(
                        source=SPECDECODE_BENCH,
                        kind="published_fit",
                        use="held_out" if is_held_out else "fit",
                        hardware="H100-SXM",
                        model=model,
                        engine="vLLM (V1)",
                        op="decode" if tokens == 1 else "verify",
                        batch=batch,
                        context_tokens=context,
                        tokens_per_seq=tokens,
                        seconds=seconds,
                    )
                )
    return points


def _specdecode_bench_draft_points() -> list[PublishedPoint]:
    """SpecDecode-Bench's EAGLE drafting-time model at its fitted batch sizes, one draft step
    each (a proposal of ``SDB_DRAFT_TOKENS`` over as many drafter forwards). Held out as the
    step model's: batches 8 and 32."""
    model = get_model("Llama-3.1-8B")
    points = []
    for batch in (1, 8, 16, 32, 64):
        for context_per_seq in (512, 2048):
            context = batch * context_per_seq
            proposal = (
                SDB_DRAFT_C_KV_S * context
                + SDB_DRAFT_C_SPEC_S * (SDB_DRAFT_TOKENS + 1)
                + SDB_DRAFT_C_FIXED_S
            )
            points.append(
                PublishedPoint(
                    source=SPECDECODE_BENCH,
                    kind="published_fit",
                    use="held_out" if batch in (8, 32) else "fit",
                    hardware="H100-SXM",
                    model=model,
                    engine="vLLM (V1)",
                    op="drafter",
                    batch=batch,
                    context_tokens=context,
                    tokens_per_seq=1,  # a chain's frontier: one token per sequence
                    seconds=proposal / SDB_DRAFT_TOKENS,
                )
            )
    return points


def published_points() -> list[PublishedPoint]:
    """Every published step latency we could verify (module docstring), the Qwen3-1.7B H100
    forward grid included."""
    sglang = PublishedPoint(
        source=SGLANG_EAGLE,
        kind="measured",
        use="held_out",
        hardware="H100-SXM",
        model=LLAMA2_7B,
        engine="SGLang",
        op="decode",
        batch=1,
        context_tokens=256,  # assumption: the prompt and answer lengths are not reported
        tokens_per_seq=1,
        seconds=1.0 / 156.0,
    )
    sglang_docs = dataclasses.replace(
        sglang,
        source=SGLANG_DOCS,
        model=get_model("Llama-3.1-8B"),
        context_tokens=512,  # assumption: an MT-bench turn and its answer
        seconds=1.0 / 158.34,
    )
    return [
        *_specdecode_bench_points(),
        *_specdecode_bench_draft_points(),
        sglang,
        sglang_docs,
        *vllm_h100_forward_points(),
    ]


# --- independent held-out data (issue #21, brief F): never fitted, other engines and GPUs -----------

LMDEPLOY_A100 = (
    "github.com/InternLM/lmdeploy docs/en/benchmark/a100_fp16.md, 'Static Inference Benchmark', "
    "llama2-7b table (lmdeploy v0.1.0a1 TurboMind, A100-80G, CUDA 11.8, tp 1)"
)
TRTLLM_050_A100 = (
    "github.com/NVIDIA/TensorRT-LLM release/0.5.0 docs/source/performance.md, 'High Throughput', "
    "'A100 GPUs (FP16)' table, LLaMA 7B, TP 1"
)


@dataclass(frozen=True, kw_only=True)
class StaticBatchPoint:
    """A published static-batch benchmark: ``batch`` requests of ``input_tokens`` prompt tokens
    each, decoded together to ``output_tokens`` each, reported as output tokens per second over
    the whole run (prefill included). Independent of the fit: other engines, sources and GPUs."""

    source: str
    engine: str
    hardware: str  # tltsim.cost.specs hardware preset
    model: ModelSpec
    batch: int
    input_tokens: int
    output_tokens: int
    output_tokens_per_s: float  # as published

    def __post_init__(self) -> None:
        for name in ("batch", "input_tokens", "output_tokens", "output_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"StaticBatchPoint: {name} must be > 0")

    @property
    def seconds_per_step(self) -> float:
        """Mean engine iteration: batch / (output tokens/s) = run seconds / output_tokens (the
        prefill amortised over the steps; a prediction must include it the same way)."""
        return self.batch / self.output_tokens_per_s


# (batch, input tokens, output tokens, output tokens/s) copied from the tables named in the sources.
# LMDeploy: all 20 llama2-7b rows; bench_costmodel.py drops those whose KV cache cannot hold the
# whole batch (the engine then queues requests: FTL(max) of 116 s at batch 64, 2048/2048).
_LMDEPLOY_LLAMA2_7B_A100 = (
    (1, 1, 128, 100.02),
    (1, 128, 128, 102.21),
    (1, 128, 2048, 98.92),
    (1, 2048, 128, 86.1),
    (1, 2048, 2048, 93.78),
    (16, 1, 128, 1504.72),
    (16, 128, 128, 1272.47),
    (16, 128, 2048, 1010.62),
    (16, 2048, 128, 348.87),
    (16, 2048, 2048, 601.63),
    (32, 1, 128, 2136.73),
    (32, 128, 128, 2125.47),
    (32, 128, 2048, 1462.12),
    (32, 2048, 128, 450.43),
    (32, 2048, 2048, 733.34),
    (64, 1, 128, 4154.81),
    (64, 128, 128, 3024.07),
    (64, 128, 2048, 1852.06),
    (64, 2048, 128, 493.46),
    (64, 2048, 2048, 755.65),
)
# TensorRT-LLM 0.5.0 (gptSessionBenchmark, static batching). LLaMA (v1) 7B has Llama-2-7B's shape
# (32 layers, hidden 4096, intermediate 11008, 32 heads, vocab 32000). The A100 memory variant is
# not stated: the A100-80GB preset is an assumption. Its H100 rows are FP8 and are not used (our
# model specs are BF16 weights; an FP8 spec would need the FP8 peak too).
_TRTLLM_050_LLAMA_7B_A100 = (
    (64, 128, 128, 3486.0),
    (32, 128, 2048, 1459.0),
    (32, 2048, 128, 529.0),
    (16, 2048, 2048, 592.0),
)


def independent_points() -> list[StaticBatchPoint]:
    """Engine-level measurements from sources independent of the fit (module docstring). The
    two SGLang batch-1 H100 points of ``published_points`` are independent too (``kind`` is
    "measured"); bench_costmodel.py shows them beside these."""
    points = []
    for source, engine, rows in (
        (LMDEPLOY_A100, "LMDeploy TurboMind v0.1.0a1", _LMDEPLOY_LLAMA2_7B_A100),
        (TRTLLM_050_A100, "TensorRT-LLM 0.5.0", _TRTLLM_050_LLAMA_7B_A100),
    ):
        for batch, prompt, output, tokens_per_s in rows:
            points.append(
                StaticBatchPoint(
                    source=source,
                    engine=engine,
                    hardware="A100-80GB",
                    model=LLAMA2_7B,
                    batch=batch,
                    input_tokens=prompt,
                    output_tokens=output,
                    output_tokens_per_s=tokens_per_s,
                )
            )
    return points


# --- a second model on H100: model-forward GPU times (vLLM, CUDA graphs) ----------------------------

VLLM_H100_QWEN3_1_7B = (
    "github.com/adixg/vllm-specdecode-cost-model results/h100_e5.json (experiment E6 of its "
    "FINDINGS.md): vLLM 0.28 V2 model runner, Qwen/Qwen3-1.7B bf16, H100 80GB (3.22 TB/s "
    "measured), FlashAttention 3, full CUDA graphs, median of 35 replays"
)
VLLM_H100_QWEN3_1_7B_LONG = (
    "github.com/adixg/vllm-specdecode-cost-model FINDINGS.md, E8 table (results/"
    "h100_ctx_straddle.json): the same engine, model and GPU, contexts up to 32,000"
)
# What is timed: vLLM's StepTimingCollector, CUDA events around the model forward of a
# ``_dummy_run`` (checked in vLLM's v1/worker/gpu/model_runner.py: forward_start before the graph
# replay, forward_end after it; compute_logits and the sampler run later, outside): the layers
# alone, no LM head, no sampling, no host scheduling. So these points are priced by
# ``RooflineCost.forward_body_s``, not ``decode_iter_s``. Decode shape: ``num_reqs`` requests of
# one new token each, every request on ``context_len`` tokens of KV (the cache, 567,584 tokens,
# holds every cell: no aliasing). Medians in ms, rows by context_len, columns by num_reqs.
_VLLM_H100_NUM_REQS = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
# fmt: off
_VLLM_H100_FORWARD_MS = {
    0: (1.9308, 1.9477, 1.9780, 1.9792, 2.0201, 2.1332, 2.1667, 2.2868, 2.3153, 2.3861, 2.3821),
    256: (1.9460, 1.9551, 1.9789, 2.0532, 2.1513, 2.3372, 2.4475, 2.6321, 2.7118, 2.8651, 2.9001),
    512: (1.9476, 1.9614, 2.0252, 2.1218, 2.3273, 2.5826, 2.7544, 2.9902, 3.1566, 3.3688, 3.4881),
    1024: (1.9632, 2.0202, 2.1118, 2.2893, 2.6365, 3.0395, 3.3479, 3.7251, 4.0406, 4.3879, 4.6556),
    2048: (1.9989, 2.0789, 2.2735, 2.6004, 3.2248, 3.9113, 4.5159, 5.1701, 5.7675, 6.4013, 6.9482),
    4096: (2.0849, 2.2576, 2.5735, 3.1892, 4.4227, 5.6308, 6.8570, 8.0804, 9.3067, 10.5102, 11.6669),
    8192: (2.2577, 2.5543, 3.1516, 4.3566, 6.7541, 9.1339, 11.5560, 13.9456, 16.2846, 18.7406, 20.9599),
}
# fmt: on
# E8's "actual_ms" column (printed to 3 decimals): (num_reqs, context_len, ms).
_VLLM_H100_LONG_FORWARD_MS = (
    (1, 1024, 2.002),
    (1, 32000, 3.158),
    (16, 1024, 2.644),
    (16, 8192, 6.806),
    (16, 16384, 11.577),
    (16, 32000, 20.628),
)
# Which grid cells a joint fit may use (fit_published): batches 1, 8, 32, 64 at contexts 0, 1024
# and 4096; the other 65 grid cells and the 6 long-context cells are held out.
VLLM_H100_FIT_REQS = (1, 8, 32, 64)
VLLM_H100_FIT_CONTEXTS = (0, 1024, 4096)


def vllm_h100_forward_points() -> list[PublishedPoint]:
    """The Qwen3-1.7B H100 model-forward times (op ``forward``: ``forward_body_s``'s scope)."""
    model = get_model("Qwen3-1.7B")

    def point(source: str, reqs: int, ctx: int, ms: float, use: str) -> PublishedPoint:
        return PublishedPoint(
            source=source,
            kind="measured",
            use=use,
            hardware="H100-SXM",
            model=model,
            engine="vLLM 0.28 (graphs)",
            op="forward",
            batch=reqs,
            context_tokens=reqs * ctx,
            tokens_per_seq=1,
            seconds=ms / 1e3,
        )

    points = []
    for ctx, row in _VLLM_H100_FORWARD_MS.items():
        for reqs, ms in zip(_VLLM_H100_NUM_REQS, row, strict=True):
            is_fit = reqs in VLLM_H100_FIT_REQS and ctx in VLLM_H100_FIT_CONTEXTS
            points.append(
                point(VLLM_H100_QWEN3_1_7B, reqs, ctx, ms, "fit" if is_fit else "held_out")
            )
    for reqs, ctx, ms in _VLLM_H100_LONG_FORWARD_MS:
        points.append(point(VLLM_H100_QWEN3_1_7B_LONG, reqs, ctx, ms, "held_out"))
    return points


def as_profile_rows(points: list[PublishedPoint]) -> list[ProfileRow]:
    """The points as tlt-profile rows (no spread reported: p10 = p90 = the value)."""
    return [
        ProfileRow(
            p.op, p.batch, p.context_tokens, p.tokens_per_seq, p.seconds, p.seconds, p.seconds, 1
        )
        for p in points
    ]


__all__ = [
    "LLAMA2_7B",
    "LMDEPLOY_A100",
    "PublishedPoint",
    "SGLANG_DOCS",
    "SGLANG_EAGLE",
    "SPECDECODE_BENCH",
    "StaticBatchPoint",
    "TRTLLM_050_A100",
    "VLLM_H100_QWEN3_1_7B",
    "VLLM_H100_QWEN3_1_7B_LONG",
    "as_profile_rows",
    "independent_points",
    "published_points",
    "vllm_h100_forward_points",
]

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
  InstructCoder contexts they fitted on are not reported either.
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
* Validation only (never fitted): EAGLE-3 (Li et al., arXiv 2503.01840, abstract): "In the
  SGLang framework, EAGLE-3 achieves a 1.38x throughput improvement at a batch size of 64"
  (LLaMA-Instruct 3.1 8B, H100, MT-bench); the same SGLang table has EAGLE-3 at batch 1:
  373.25 / 158.34 = 2.36x. The draft strategy and accept length at batch 64 are not given in
  what we could read, so a simulation cannot be set up to match it exactly (``SD_SPEEDUPS``).
* Independent held-out data, never fitted (``independent_points``, ``StaticBatchPoint``; brief F
  of issue #21): static-batch benchmarks (output tokens/s of ``batch`` requests decoded together,
  prefill included) of Llama-2-7B on A100 FP16 from LMDeploy's TurboMind (v0.1.0a1, all 20
  llama2-7b rows of docs/en/benchmark/a100_fp16.md) and of LLaMA-7B from TensorRT-LLM 0.5.0's
  A100 FP16 table (docs/source/performance.md). Other engines, sources and GPU than the fit: an
  A100 result is a transfer test of the H100 calibration's fractions, not a calibration.
* Not found (searched: docs/pages/issues/code corpora, Nov 2026): H100 or H200 BF16 step latency or
  throughput at several batch sizes for a 7-8B model whose numbers we could read as text
  (TensorRT-LLM's H100 rows are FP8; vLLM's and SGLang's batch scans are figures or dashboards),
  TP all-reduce timings, per-draft-step timings, and SD-speedup-vs-batch tables with the accept
  lengths needed to set up a matching simulation (the EAGLE-3 paper's SGLang batch table and
  SpecDecode-Bench's measured speedups are figures or not in readable text here). H200 and A100
  presets therefore stay on the roofline.
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
EAGLE3_PAPER = "EAGLE-3, arXiv 2503.01840, abstract (SGLang, H100, LLaMA-Instruct 3.1 8B)"
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
    op: str  # tlt-profile op: decode or verify
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


def published_points() -> list[PublishedPoint]:
    """Every published step latency we could verify (module docstring)."""
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
    return [*_specdecode_bench_points(), sglang, sglang_docs]


@dataclass(frozen=True, kw_only=True)
class PublishedSpeedup:
    """A published SD throughput speedup vs batch: validation data, never fitted."""

    source: str
    hardware: str
    model: str
    engine: str
    method: str
    batch: int
    speedup: float


# EAGLE-3 in SGLang on one H100, LLaMA-Instruct 3.1 8B, MT-bench: 2.36x at batch 1 (SGLang docs
# table, 373.25 / 158.34 tokens/s), 1.38x at batch 64 (arXiv 2503.01840 abstract).
SD_SPEEDUPS = (
    PublishedSpeedup(
        source=SGLANG_DOCS,
        hardware="H100-SXM",
        model="Llama-3.1-8B",
        engine="SGLang",
        method="EAGLE-3",
        batch=1,
        speedup=373.25 / 158.34,
    ),
    PublishedSpeedup(
        source=EAGLE3_PAPER,
        hardware="H100-SXM",
        model="Llama-3.1-8B",
        engine="SGLang",
        method="EAGLE-3",
        batch=64,
        speedup=1.38,
    ),
)


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


def as_profile_rows(points: list[PublishedPoint]) -> list[ProfileRow]:
    """The points as tlt-profile rows (no spread reported: p10 = p90 = the value)."""
    return [
        ProfileRow(
            p.op, p.batch, p.context_tokens, p.tokens_per_seq, p.seconds, p.seconds, p.seconds, 1
        )
        for p in points
    ]


__all__ = [
    "EAGLE3_PAPER",
    "LLAMA2_7B",
    "LMDEPLOY_A100",
    "PublishedPoint",
    "PublishedSpeedup",
    "SD_SPEEDUPS",
    "SGLANG_DOCS",
    "SGLANG_EAGLE",
    "SPECDECODE_BENCH",
    "StaticBatchPoint",
    "TRTLLM_050_A100",
    "as_profile_rows",
    "independent_points",
    "published_points",
]

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
* Not found: H200 or A100 step-latency tables we could verify, TP all-reduce timings, per-draft-
  step timings, and published SD-speedup-vs-batch measurements with the accept lengths needed to
  compare against a simulation. H200 and A100 presets therefore stay on the roofline.
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
    "PublishedPoint",
    "PublishedSpeedup",
    "SD_SPEEDUPS",
    "SGLANG_DOCS",
    "SGLANG_EAGLE",
    "SPECDECODE_BENCH",
    "as_profile_rows",
    "published_points",
]

"""Published SD speedup vs batch size: validation data for the cost model, never fitted.

Each ``SDBatchSeries`` is one published series of SD throughput speedup at several batch sizes
with everything a like-for-like simulation needs (engine, GPU, target, drafter, strategy).
``benchmarks/sd_batch_validation.py`` simulates each and reports where SD stops paying against
where the source shows it stop (issue #21). The step latencies the calibration IS fitted on live
in ``tltsim.cost.published``; SD speedup figures never enter a fit.

    from tltsim.cost.published_sd import SD_BATCH_SERIES
    for s in SD_BATCH_SERIES:
        print(s.name, s.strategy, s.batches, s.speedups)
"""

from __future__ import annotations

from dataclasses import dataclass

from tltsim.policy import SpecDecision

EAGLE3_TABLE3 = (
    "Li et al., 'EAGLE-3: Scaling up Inference Acceleration of Large Language Models via "
    "Training-Time Test', arXiv 2503.01840 (v3), Sec. 4.3, Table 3 (run by the SGLang team)"
)
_SDB_PAPER = "Liu et al., 'Speculative Decoding: Performance or Illusion?', arXiv 2601.11580"
SDB_FIG1 = f"{_SDB_PAPER}, Fig. 1 (specdecode-bench.github.io, assets/img/fig1.pdf)"
SDB_FIG2 = f"{_SDB_PAPER}, Fig. 2 (specdecode-bench.github.io, assets/img/fig2.pdf)"
# EAGLE-3 drafters predict over a 32k sub-vocabulary (draft_vocab_size 32000 in the SpecForge-style
# llama3-8B-eagle3.json / qwen3-*-eagle3.json configs quoted in public repositories); the
# checkpoints the benchmarks loaded are not named. EAGLE-1 drafters use the full LM head.
EAGLE3_DRAFT_VOCAB = 32000
SDB_BATCHES = (1, 16, 64, 128)

# Strategy mapping (ours; no source gives launch flags). tltsim names a chain of k drafted tokens
# k_1_k (verify_tokens = draft steps; the verify forward feeds the k drafts plus the root).
# EAGLE-3's "chain length was set to 3" and SpecDecode-Bench's "3 draft tokens per step (k=3,
# does not include the bonus token)" -> 3_1_3 (SGLang: --speculative-num-steps 3
# --speculative-eagle-topk 1 --speculative-num-draft-tokens 4); "chain length 3" could also be
# read as 3 tokens verified with the root, i.e. 2_1_2. Fig. 2's trees have depth 3 and "k denotes
# the total number of draft tokens verified in parallel": k=6 branching 2 -> 3_2_6, k=21
# branching 4 -> 3_4_21, reading k without the root as for their chain (its printed acceptance
# rate 0.415 = (2.25 - 1) / 3). If k were SGLang's num_draft_tokens (root included) the trees
# would be 3_2_5 and 3_4_20; the printed rate of the k=21 tree, 0.095, lies between
# (2.92 - 1) / 21 = 0.091 and / 20 = 0.096, so it does not settle which.
_CHAIN3 = "3_1_3"


@dataclass(frozen=True, kw_only=True)
class SDBatchSeries:
    """One published series of SD throughput speedup (SD tokens/s over plain tokens/s, same
    engine) at several batch sizes, with everything a like-for-like simulation needs."""

    name: str  # short label for tables
    source: str  # title, arXiv id, table or figure
    engine: str  # and its version
    hardware: str  # tltsim.cost.specs hardware preset
    target: str  # the target model as published
    model: str  # tltsim.cost.specs model preset of the same shape
    drafter: str  # EAGLE-3 or EAGLE (EAGLE-1)
    draft_vocab_size: int | None  # the drafter's LM-head rows; None: the target's vocabulary
    published_strategy: str  # the strategy in the source's words
    strategy: str  # the same in tltsim naming (mapping above)
    dataset: str
    accept_len: float | None  # published mean accept length (incl. the bonus token), if any
    batches: tuple[int, ...]
    speedups: tuple[float, ...]
    is_read_from_figure: bool  # values read off a vector figure (+-0.005), not printed

    def __post_init__(self) -> None:
        if len(self.batches) != len(self.speedups) or len(self.batches) < 2:
            raise ValueError(f"SDBatchSeries {self.name!r}: need one speedup per batch (>= 2)")
        if list(self.batches) != sorted(set(self.batches)) or self.batches[0] < 1:
            raise ValueError(f"SDBatchSeries {self.name!r}: batches must increase from >= 1")
        if not all(v > 0 for v in self.speedups):
            raise ValueError(f"SDBatchSeries {self.name!r}: speedups must be > 0")
        if self.accept_len is not None and not self.accept_len >= 1.0:
            raise ValueError(f"SDBatchSeries {self.name!r}: accept_len must be >= 1")
        SpecDecision.parse(self.strategy)  # a tltsim strategy name, or ValueError


def _eagle3_table3() -> list[SDBatchSeries]:
    """Single H100 (SXM assumed), SGLang v0.4.4, MT-Bench, "did not use the tree structure, the
    chain length was set to 3"; baseline: SGLang without SD (1.00x). No accept lengths."""
    batches = (2, 4, 8, 16, 24, 32, 48, 56, 64)
    rows = (
        ("EAGLE-3", EAGLE3_DRAFT_VOCAB, (1.81, 1.82, 1.62, 1.48, 1.39, 1.32, 1.38, 1.34, 1.38)),
        ("EAGLE", None, (1.40, 1.38, 1.23, 1.02, 0.93, 0.94, 0.88, 0.99, 0.99)),
    )
    return [
        SDBatchSeries(
            name=f"T3 {drafter} MT-Bench",
            source=EAGLE3_TABLE3,
            engine="SGLang v0.4.4",
            hardware="H100-SXM",
            target="LLaMA-Instruct 3.1 8B",
            model="Llama-3.1-8B",
            drafter=drafter,
            draft_vocab_size=vocab,
            published_strategy="chain length 3, no tree",
            strategy=_CHAIN3,
            dataset="MT-Bench",
            accept_len=None,
            batches=batches,
            speedups=speedups,
            is_read_from_figure=False,
        )
        for drafter, vocab, speedups in rows
    ]


# Values read from the figures' vector PDFs (plotted vertices mapped onto the gridlines; ticks read
# from the rendered figure), +-0.005; checked against the blog's printed 1.21x (EAGLE, Llama-8B,
# GSM8K, batch 128) and 1.65x / 1.85x (Qwen3-8B, GSM8K, batch 1) (research notes of issue #21).
_FIG1_LLAMA8B_EAGLE3 = (  # vLLM v0.10.1, 1x H100 80GB, CUDA graphs, k=3
    ("GSM8K", (1.749, 1.699, 1.486, 1.222)),
    ("CNN/DailyMail", (1.686, 1.581, 1.397, 1.235)),
    ("ShareGPT", (1.712, 1.677, 1.550, 1.296)),
    ("InstructCoder", (2.020, 1.917, 1.572, 1.309)),
)
# SGLang v0.5.9, Qwen3-8B, EAGLE-3; accept lengths as printed in the text: "2.25 -> 2.92 on
# Qwen3-8B/GSM8K" (chain k=3 -> tree k=21); none for the other cells.
_FIG2_QWEN3_8B = (  # (label, published strategy, tltsim strategy, {dataset: (accept_len, speedups)})
    (
        "chain",
        "chain k=3",
        _CHAIN3,
        {
            "GSM8K": (2.25, (1.648, 1.577, 1.311, 1.220)),
            "CNN/DailyMail": (None, (1.602, 1.508, 1.280, 1.242)),
            "ShareGPT": (None, (1.426, 1.388, 1.202, 1.107)),
            "InstructCoder": (None, (1.796, 1.648, 1.310, 1.257)),
        },
    ),
    (
        "tree6",
        "tree depth 3, k=6, branching 2",
        "3_2_6",
        {
            "GSM8K": (None, (1.677, 1.501, 1.093, 1.033)),
            "CNN/DailyMail": (None, (1.615, 1.324, 0.984, 0.940)),
            "ShareGPT": (None, (1.467, 1.281, 0.930, 0.855)),
            "InstructCoder": (None, (1.770, 1.511, 1.098, 1.046)),
        },
    ),
    (
        "tree21",
        "tree depth 3, k=21, branching 4",
        "3_4_21",
        {
            "GSM8K": (2.92, (1.848, 1.336, 0.584, 0.557)),
            "CNN/DailyMail": (None, (1.730, 1.172, 0.628, 0.607)),
            "ShareGPT": (None, (1.593, 1.138, 0.527, 0.492)),
            "InstructCoder": (None, (1.824, 1.279, 0.624, 0.598)),
        },
    ),
)


def _specdecode_bench_figures() -> list[SDBatchSeries]:
    """Fig. 1: "NVIDIA H100 80GB GPUs---1 GPU for 8B models" (SXM assumed); Fig. 2's caption
    names no GPU, the study says "All experiments use NVIDIA H100 GPUs"."""
    series = [
        SDBatchSeries(
            name=f"F1 chain {dataset}",
            source=SDB_FIG1,
            engine="vLLM v0.10.1",
            hardware="H100-SXM",
            target="Llama-3.1-8B-Instruct",
            model="Llama-3.1-8B",
            drafter="EAGLE-3",
            draft_vocab_size=EAGLE3_DRAFT_VOCAB,
            published_strategy="chain k=3 (3 draft tokens, bonus token not counted)",
            strategy=_CHAIN3,
            dataset=dataset,
            accept_len=None,
            batches=SDB_BATCHES,
            speedups=speedups,
            is_read_from_figure=True,
        )
        for dataset, speedups in _FIG1_LLAMA8B_EAGLE3
    ]
    for short, published, strategy, cells in _FIG2_QWEN3_8B:
        for dataset, (accept_len, speedups) in cells.items():
            series.append(
                SDBatchSeries(
                    name=f"F2 {short} {dataset}",
                    source=SDB_FIG2,
                    engine="SGLang v0.5.9",
                    hardware="H100-SXM",
                    target="Qwen3-8B",
                    model="Qwen3-8B",
                    drafter="EAGLE-3",
                    draft_vocab_size=EAGLE3_DRAFT_VOCAB,
                    published_strategy=published,
                    strategy=strategy,
                    dataset=dataset,
                    accept_len=accept_len,
                    batches=SDB_BATCHES,
                    speedups=speedups,
                    is_read_from_figure=True,
                )
            )
    return series


# Every published SD-vs-batch series we could verify (research notes of issue #21). Left out:
# EAGLE-3's Table 5 (vLLM, chain of 2; its GPU is RTX3090 in the text, A100 in one caption).
SD_BATCH_SERIES: tuple[SDBatchSeries, ...] = (*_eagle3_table3(), *_specdecode_bench_figures())


__all__ = [
    "EAGLE3_DRAFT_VOCAB",
    "EAGLE3_TABLE3",
    "SDBatchSeries",
    "SDB_FIG1",
    "SDB_FIG2",
    "SD_BATCH_SERIES",
]

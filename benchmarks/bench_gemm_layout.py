"""Why ``tltrun.model.transformer.gemm_layout`` stores Linear weights column-major: fp32 CPU GEMM time of
``F.linear(x, W)`` with W row-major (PyTorch's default) vs column-major (same values), for this
project's model shapes and the row counts of decoding (batch), verification (batch x verify
tokens) and prefill/training (hundreds of rows); then, with ``--model-dir`` / ``--drafter-dir``
(``benchmarks/bench_spec.py``'s models), whole rollouts of the torch engine with either layout.

Both layouts are timed in the same process, alternating every repeat (this machine is shared:
compare the ratio, not the absolute times), on one torch thread (as the engine benchmarks).

Run: ``python benchmarks/bench_gemm_layout.py`` (~1 minute; ~3 more with the models). Prints
a table and writes ``results.json`` + ``config.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from tltsim.cli.args import add_dataclass_args, dataclass_from_args
from tltsim.cli.table import format_table
from tltsim.errors import UsageError
from tltsim.jsonio import write_json


@dataclass(frozen=True)
class BenchGemmConfig:
    out: str = field(
        default="runs/bench_gemm_layout", metadata={"help": "output directory", "metavar": "DIR"}
    )
    # (in, out) of bench_spec's 8-layer model (hidden 512, MLP 1376, q/k/v/o) and
    # bench_fidelity's 4-layer one (hidden 256, MLP 704)
    shapes: tuple[str, ...] = field(
        default=("512x512", "512x1376", "1376x512", "256x256", "256x704", "704x256"),
        metadata={"help": "weight shapes INxOUT timed"},
    )
    rows: tuple[int, ...] = field(
        default=(1, 4, 5, 8, 16, 20, 40, 80, 256, 1024),
        metadata={"help": "input rows (tokens) per GEMM"},
    )
    num_repeats: int = field(
        default=30, metadata={"help": "timed calls per layout, shape and row count"}
    )
    seed: int = field(default=0, metadata={"help": "seed of the random weights and inputs"})
    # optional engine rollouts (bench_spec.py's outputs); skipped when the directory is absent
    model_dir: str = field(
        default="runs/bench_spec/target",
        metadata={
            "help": "target of the rollouts (bench_spec.py's); skipped when absent",
            "metavar": "DIR",
        },
    )
    drafter_dir: str = field(
        default="runs/bench_spec/drafter",
        metadata={"help": "drafter of the rollouts (bench_spec.py's)", "metavar": "DIR"},
    )
    batches: tuple[int, ...] = field(default=(1, 4, 8), metadata={"help": "rollout batch sizes"})
    strategy: str = field(
        default="4_1_4", metadata={"help": "SD strategy of the rollouts (besides nospec)"}
    )
    max_new_tokens: int = field(
        default=128, metadata={"help": "tokens each rollout request generates"}
    )
    num_rollouts: int = field(default=4, metadata={"help": "timed rollouts per layout and batch"})


def col_major(w: torch.Tensor) -> torch.Tensor:
    return w.t().contiguous().t()


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench_gemm(cfg: BenchGemmConfig) -> list[dict]:
    gen = torch.Generator().manual_seed(cfg.seed)
    rows = []
    for shape in cfg.shapes:
        try:
            k, n = (int(v) for v in shape.split("x"))
        except ValueError:
            raise UsageError(f"--shapes {shape}: expected IN x OUT, e.g. 512x1376") from None
        w = torch.randn(n, k, generator=gen)
        layouts = {"row": w, "col": col_major(w)}
        for m in cfg.rows:
            x = torch.randn(m, k, generator=gen)
            # another kernel may round differently; a wrong product must not pass
            assert torch.allclose(F.linear(x, layouts["row"]), F.linear(x, layouts["col"]),
                                  rtol=1e-4, atol=1e-4)  # fmt: skip
            inner = max(1, int(2e6 // (m * k * n) + 1))  # ~ms-long samples for tiny products

            def call(wt, x=x, inner=inner):
                for _ in range(inner):
                    F.linear(x, wt)

            times = {name: [] for name in layouts}
            for wt in layouts.values():  # warm-up
                call(wt)
            for _ in range(cfg.num_repeats):
                for name, wt in layouts.items():
                    times[name].append(_timed(lambda wt=wt: call(wt)) / inner)
            row_us = 1e6 * statistics.median(times["row"])
            col_us = 1e6 * statistics.median(times["col"])
            rows.append({"in": k, "out": n, "rows": m, "row_major_us": row_us,
                         "col_major_us": col_us, "speedup": row_us / col_us})  # fmt: skip
    return rows


def bench_engine(cfg: BenchGemmConfig) -> list[dict]:
    """Greedy rollouts of task prompts, NoSpec and a chain, with both layouts (same outputs)."""
    import random

    from tltrun.model.drafter import load_drafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.model.tokenizer import CharTokenizer
    from tltrun.rollout.engine import RolloutEngine
    from tltrun.rollout.engine_config import EngineConfig
    from tltrun.rollout.interface import Request, SamplingParams
    from tltrun.train.tasks import TaskConfig, make_examples
    from tltsim.policy import NoSpec, StaticSpec

    models = {}
    for layout in ("row", "col"):
        target = load_hf(cfg.model_dir)
        drafter = load_drafter(cfg.drafter_dir, target)
        if layout == "row":  # undo gemm_layout: PyTorch's default layout
            for module in (target, drafter):
                for p in module.parameters():
                    p.data = p.data.contiguous()
        models[layout] = (target, drafter)
    tok = CharTokenizer.load(cfg.model_dir)
    policies = {"nospec": NoSpec(), cfg.strategy: StaticSpec(strategy=cfg.strategy)}
    out = []
    for b in cfg.batches:
        examples = make_examples(TaskConfig(), random.Random(cfg.seed), b)
        prompts = [tuple(tok.encode(e.prompt, add_bos=True)) for e in examples]
        ecfg = EngineConfig(b, max(map(len, prompts)) + cfg.max_new_tokens + 16,
                            SamplingParams(0.0), seed=cfg.seed)  # fmt: skip
        engines = {lay: RolloutEngine(t, d, ecfg) for lay, (t, d) in models.items()}
        times, outputs = {}, {}
        for rep in range(cfg.num_rollouts + 1):  # rollout 0 warms up
            for layout, engine in engines.items():
                for name, policy in policies.items():
                    reqs = [Request(f"{name}{rep}/{i}", p, cfg.max_new_tokens, True)
                            for i, p in enumerate(prompts)]  # fmt: skip
                    start = time.perf_counter()
                    result = engine.generate(reqs, policy)
                    if rep:
                        times.setdefault((layout, name), []).append(time.perf_counter() - start)
                    outputs[(layout, name)] = [o.output_token_ids for o in result.outputs]
        for name in policies:
            row_s = statistics.median(times[("row", name)])
            col_s = statistics.median(times[("col", name)])
            out.append({"batch": b, "policy": name, "row_major_s": row_s, "col_major_s": col_s,
                        "speedup": row_s / col_s,
                        "same_tokens": outputs[("row", name)] == outputs[("col", name)]})  # fmt: skip
    return out


GEMM_COLUMNS = {
    "shape": "in->out",
    "rows": "rows",
    "row_major_us": "row-major",
    "col_major_us": "col-major",
    "speedup": "speedup",
}
GEMM_FORMATS = {"row_major_us": ".1f", "col_major_us": ".1f", "speedup": "{:.2f}x"}
ENGINE_COLUMNS = {
    "batch": "batch",
    "policy": "policy",
    "row_major_s": "row-major",
    "col_major_s": "col-major",
    "speedup": "speedup",
    "same_tokens": "same",
}
ENGINE_FORMATS = {"row_major_s": ".3f", "col_major_s": ".3f", "speedup": "{:.2f}x"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_dataclass_args(parser, BenchGemmConfig)
    cfg = dataclass_from_args(BenchGemmConfig, parser.parse_args(argv))
    torch.set_num_threads(1)
    out = Path(cfg.out)
    try:
        gemm = bench_gemm(cfg)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"fp32 F.linear, 1 thread, median of {cfg.num_repeats} (microseconds)")
    shapes = [{**r, "shape": f"{r['in']}->{r['out']}"} for r in gemm]
    print(format_table(shapes, GEMM_COLUMNS, GEMM_FORMATS))
    engine = []
    if Path(cfg.model_dir).is_dir() and Path(cfg.drafter_dir).is_dir():
        engine = bench_engine(cfg)
        print(f"\ntorch engine rollouts ({cfg.model_dir}), median of {cfg.num_rollouts} (seconds)")
        print(format_table(engine, ENGINE_COLUMNS, ENGINE_FORMATS))
    else:
        print(f"\n(no {cfg.model_dir} / {cfg.drafter_dir}: engine rollouts skipped; "
              "run benchmarks/bench_spec.py first)")  # fmt: skip
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "config.json", asdict(cfg))
    write_json(out / "results.json", {"gemm": gemm, "engine": engine,
               "torch": torch.__version__, "num_threads": 1})  # fmt: skip
    print(f"\nwrote {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

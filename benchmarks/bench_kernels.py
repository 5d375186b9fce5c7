"""Benchmark of the Triton kernels (kernels/) against their torch references, on a CUDA GPU.

For each shape it reports the median time over many runs (``triton.testing.do_bench``, CUDA
events), the speedup of the kernel over the reference, and bandwidth: the floor for reading
every probability (or logit) once at the device's peak HBM bandwidth, the kernel's time
relative to that floor, and the bandwidth the kernel achieves on the bytes it actually has to
read. Then, if tltrun.rollout.engine is importable, the effect on a full SD iteration of the
torch engine (verify_impl / attn_impl "ref"/"sdpa" vs "triton"). Issue #8 target: fused verify
>= 3x faster than the reference at B = 64, k = 8, V = 152064, within 2x of the bandwidth floor.

Why ``do_bench``: it clears the L2 cache (zeroing a 256 MB buffer) before every timed run. These
kernels are memory-bound; a loop that calls them back to back on a warm L2 serves part of each
call's reads from the cache lines the previous call left (an H100 has 50 MB of L2: the 10 MB of
a whole B = 1 verify fit), a bandwidth they do not get inside an SD iteration, where the model's
forward pass runs in between, and that overstates the speedup of the kernel that reads least.

Run: python benchmarks/bench_kernels.py [--out_dir results/bench_kernels] [--rep_ms 100]
Writes OUT_DIR/config.json and OUT_DIR/bench_kernels.json, prints a table. Without CUDA it
prints that it needs a GPU and exits 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels.spec_verify import spec_verify, spec_verify_from_logits
from kernels.tree_attention import tree_attention
from tltsim.cli.table import format_table

# Peak HBM bandwidth by device name, from NVIDIA's datasheets:
#   H100 SXM 3.35 TB/s, H100 PCIe 2.0 TB/s, H100 NVL 3.9 TB/s: NVIDIA H100 Tensor Core GPU
#     datasheet, https://www.nvidia.com/en-us/data-center/h100/ (specifications table)
#   H200 SXM / NVL 4.8 TB/s: https://www.nvidia.com/en-us/data-center/h200/
#   A100 80GB SXM 2,039 GB/s, 80GB PCIe 1,935 GB/s, 40GB 1,555 GB/s:
#     https://www.nvidia.com/en-us/data-center/a100/
# Matched in order, first hit wins (so "H100 NVL" and "H100 PCIe" before the SXM "H100").
PEAK_HBM_BYTES_PER_S = (
    ("H200", 4.8e12),
    ("H100 NVL", 3.9e12),
    ("H100 PCIe", 2.0e12),
    ("H100", 3.35e12),
    ("A100-SXM4-80GB", 2.039e12),
    ("A100 80GB PCIe", 1.935e12),
    ("A100", 1.555e12),
)
SPEC_SHAPES = ((64, 8, 152064), (16, 8, 152064), (1, 8, 152064), (64, 4, 32000), (64, 8, 32000))
# (B, H, Hkv, T, D, L): Qwen2.5-7B attention (28 query heads, 4 KV heads, head dim 128; its
# config.json) with a 64-token draft tree (TLT's largest public strategy verifies 48 + 1, see
# tltrun.rollout.engine) or an 8-token chain, at several context lengths
TREE_SHAPES = ((64, 28, 4, 8, 128, 2048), (16, 28, 4, 64, 128, 4096), (1, 28, 4, 64, 128, 16384))


@dataclass(frozen=True)
class BenchConfig:
    out_dir: str = "results/bench_kernels"
    # do_bench's budgets in milliseconds (it turns them into run counts from a first estimate)
    warmup_ms: int = 25
    rep_ms: int = 100
    seed: int = 0
    is_engine_measured: bool = True
    engine_num_requests: int = 64
    engine_max_new_tokens: int = 64

    def __post_init__(self) -> None:
        if self.warmup_ms < 0 or self.rep_ms < 1:
            raise ValueError("warmup_ms >= 0 and rep_ms >= 1 required")
        if self.engine_num_requests < 1 or self.engine_max_new_tokens < 1:
            raise ValueError("engine_num_requests and engine_max_new_tokens must be >= 1")


def peak_bandwidth(props) -> tuple[float, str]:
    """(bytes/s, where the number comes from) for a torch.cuda device properties object."""
    for key, value in PEAK_HBM_BYTES_PER_S:
        if key in props.name:
            return value, f"datasheet ({key})"
    clock_khz = getattr(props, "memory_clock_rate", 0)  # present in recent torch builds
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:  # double data rate: 2 transfers per clock (CUDA bandwidthTest)
        return 2.0 * clock_khz * 1e3 * bus_bits / 8, "memory clock x bus width"
    return float("nan"), "unknown device"


def median_ms(fn, cfg: BenchConfig) -> float:
    """Median milliseconds of ``fn`` on a cold L2 (module docstring: why)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=cfg.warmup_ms, rep=cfg.rep_ms, return_mode="median")


def _spec_inputs(shape, gen: torch.Generator) -> dict:
    """Drafts close to the target for half the batch (long accepted runs), unrelated for the
    other half, so the kernel sees both early rejections and full acceptance."""
    num_seqs, k, vocab = shape
    base = torch.randn(num_seqs, k + 1, vocab, generator=gen, device="cuda") * 3
    target_logits = base + 0.3 * torch.randn(base.shape, generator=gen, device="cuda")
    noise = torch.randn(num_seqs, k, vocab, generator=gen, device="cuda")
    is_close = (torch.arange(num_seqs, device="cuda") < (num_seqs + 1) // 2).view(-1, 1, 1)
    draft_logits = torch.where(is_close, base[:, :k] + 0.3 * noise, 3 * noise)
    draft_probs = torch.softmax(draft_logits, dim=-1)
    tokens = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen)
    return {
        "target_logits": target_logits,
        "draft_logits": draft_logits,
        "target_probs": torch.softmax(target_logits, dim=-1),
        "draft_probs": draft_probs,
        "draft_tokens": tokens.reshape(num_seqs, k),
        "u_accept": torch.rand(num_seqs, k, generator=gen, device="cuda"),
        "u_sample": torch.rand(num_seqs, generator=gen, device="cuda"),
    }


def _bytes_read(num_accepted: torch.Tensor, k: int, vocab: int, is_logits: bool) -> int:
    """Bytes (fp32) the fused kernel must read for these outcomes: two passes over the row(s)
    the next token is drawn from (p_n and q_n, or p_k alone), plus, for logits, one
    normalising pass over target and draft rows 0..n (and the bonus row when n == k)."""
    n = num_accepted.long()
    rows_sampled = torch.where(n < k, 2, 1)
    total_rows = 2 * rows_sampled
    if is_logits:
        total_rows = total_rows + 2 * torch.clamp(n + 1, max=k) + (n == k).long()
    return int(total_rows.sum()) * vocab * 4


def bench_spec_verify(cfg: BenchConfig, peak: float, gen: torch.Generator) -> list[dict]:
    rows = []
    for shape in SPEC_SHAPES:
        num_seqs, k, vocab = shape
        x = _spec_inputs(shape, gen)
        all_bytes = (2 * k + 1) * num_seqs * vocab * 4  # target (k+1 rows) + draft (k rows)
        floor_ms = all_bytes / peak * 1e3
        probs_args = (x["target_probs"], x["draft_probs"], x["draft_tokens"], x["u_accept"],
                      x["u_sample"])  # fmt: skip
        logits_args = (x["target_logits"], x["draft_logits"], x["draft_tokens"], x["u_accept"],
                       x["u_sample"], 1.0)  # fmt: skip
        for entry, fn, args in (("probs", spec_verify, probs_args),
                                ("logits", spec_verify_from_logits, logits_args)):  # fmt: skip
            ref_ms = median_ms(lambda fn=fn, args=args: fn(*args, impl="ref"), cfg)
            kernel_ms = median_ms(lambda fn=fn, args=args: fn(*args, impl="triton"), cfg)
            num_accepted = fn(*args, impl="triton")[1]
            needed = _bytes_read(num_accepted, k, vocab, entry == "logits")
            rows.append({
                "kernel": f"spec_verify[{entry}]", "shape": f"B={num_seqs} k={k} V={vocab}",
                "ref_ms": ref_ms, "triton_ms": kernel_ms, "speedup": ref_ms / kernel_ms,
                "read_all_once_floor_ms": floor_ms, "triton_over_floor": kernel_ms / floor_ms,
                "needed_bytes": needed, "achieved_GBps": needed / kernel_ms / 1e6,
                "mean_accepted": float(num_accepted.float().mean()),
            })  # fmt: skip
    return rows


def _sdpa_baseline(q, k_cache, v_cache, cache_lens, k_new, v_new, tree_mask, scale):
    """The engine's "sdpa" path in spirit: one masked SDPA over [cache, new] keys."""
    max_len = k_cache.shape[2]
    keys = torch.cat([k_cache, k_new], dim=2)
    values = torch.cat([v_cache, v_new], dim=2)
    is_prefix = torch.arange(max_len, device=q.device)[None, :] < cache_lens[:, None]
    num_tokens = q.shape[2]
    allowed = torch.cat([is_prefix[:, None, :].expand(-1, num_tokens, -1), tree_mask], dim=2)
    return torch.nn.functional.scaled_dot_product_attention(
        q, keys, values, attn_mask=allowed[:, None], scale=scale, enable_gqa=True
    )


def bench_tree_attention(cfg: BenchConfig, peak: float, gen: torch.Generator) -> list[dict]:
    rows = []
    for shape in TREE_SHAPES:
        num_seqs, num_heads, num_kv_heads, num_tokens, head_dim, max_len = shape

        def randn(*size):
            return torch.randn(*size, generator=gen, device="cuda").to(torch.bfloat16)

        parents = (torch.arange(num_tokens, device="cuda") - 1).clamp(min=0) // 2  # binary tree
        mask = torch.eye(num_tokens, dtype=torch.bool, device="cuda")
        for i in range(1, num_tokens):
            mask[i] |= mask[parents[i]]
        args = (
            randn(num_seqs, num_heads, num_tokens, head_dim),
            randn(num_seqs, num_kv_heads, max_len, head_dim),
            randn(num_seqs, num_kv_heads, max_len, head_dim),
            torch.full((num_seqs,), max_len, device="cuda"),
            randn(num_seqs, num_kv_heads, num_tokens, head_dim),
            randn(num_seqs, num_kv_heads, num_tokens, head_dim),
            mask.expand(num_seqs, -1, -1).contiguous(),
            head_dim**-0.5,
        )
        kv_bytes = 2 * num_seqs * num_kv_heads * (max_len + num_tokens) * head_dim * 2  # bf16
        ref_ms = median_ms(lambda a=args: tree_attention(*a, impl="ref"), cfg)
        sdpa_ms = median_ms(lambda a=args: _sdpa_baseline(*a), cfg)
        kernel_ms = median_ms(lambda a=args: tree_attention(*a, impl="triton"), cfg)
        rows.append({
            "kernel": "tree_attention[bf16]", "shape": "B={} H={} Hkv={} T={} D={} L={}".format(
                *shape), "ref_ms": ref_ms, "sdpa_ms": sdpa_ms, "triton_ms": kernel_ms,
            "speedup": ref_ms / kernel_ms, "speedup_vs_sdpa": sdpa_ms / kernel_ms,
            "read_all_once_floor_ms": kv_bytes / peak * 1e3,
            "triton_over_floor": kernel_ms / (kv_bytes / peak * 1e3),
            "needed_bytes": kv_bytes, "achieved_GBps": kv_bytes / kernel_ms / 1e6,
        })  # fmt: skip
    return rows


# Qwen2.5-0.5B's dimensions (its config.json: hidden 896, 14 heads, 2 KV heads, head dim 64,
# intermediate 4864, vocab 151936 padded here to Qwen2.5-7B's 152064), 4 of its 24 layers so the
# verify step is a visible share of the iteration; random weights (timing only).
ENGINE_MODEL = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=896, intermediate_size=4864,
    num_hidden_layers=4, num_attention_heads=14, num_key_value_heads=2, head_dim=64,
    attention_bias=True, tie_word_embeddings=True, max_position_embeddings=4096,
)  # fmt: skip
ENGINE_IMPLS = (("ref", "sdpa"), ("triton", "sdpa"), ("triton", "triton"))  # verify, attention
PROMPT_TOKENS = 32


def bench_engine(cfg: BenchConfig, device="cuda", dtype="bfloat16", model_overrides=None,
                 impls=ENGINE_IMPLS) -> list[dict]:  # fmt: skip
    """Median wall seconds of the SD iterations of one rollout (chain of 8 drafts, sampling at
    temperature 1) per (verify_impl, attn_impl); the rest of the engine is identical."""
    try:
        from tltrun.model.config import ModelConfig
        from tltrun.model.drafter import EagleDrafter
        from tltrun.model.transformer import Transformer
        from tltrun.rollout.engine import RolloutEngine
        from tltrun.rollout.engine_config import EngineConfig
        from tltrun.rollout.interface import Request, SamplingParams
        from tltsim.policy import StaticSpec
    except ImportError as err:
        return [
            {"note": f"tltrun.rollout.engine is not importable ({err}): SD iteration not measured"}
        ]
    model_cfg = ModelConfig(**{**ENGINE_MODEL, **(model_overrides or {})})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = Transformer(model_cfg)
    drafter = EagleDrafter.for_target(model, seed=cfg.seed)
    gen = torch.Generator().manual_seed(cfg.seed)
    requests = [
        Request(f"r{i}", tuple(torch.randint(4, model_cfg.vocab_size, (PROMPT_TOKENS,),
                                             generator=gen).tolist()),
                cfg.engine_max_new_tokens, ignore_eos=True)
        for i in range(cfg.engine_num_requests)
    ]  # fmt: skip
    rows = []
    for verify_impl, attn_impl in impls:
        engine_cfg = EngineConfig(
            max_running_requests=cfg.engine_num_requests,
            max_model_len=PROMPT_TOKENS + cfg.engine_max_new_tokens,
            sampling=SamplingParams(temperature=1.0), seed=cfg.seed, device=device, dtype=dtype,
            attn_impl=attn_impl, verify_impl=verify_impl,
            cuda_graphs=False,  # every row eager: the pool captures sdpa rows, not Triton's
        )  # fmt: skip
        engine = RolloutEngine(model, drafter, engine_cfg)
        policy = StaticSpec(draft_steps=8, topk=1, verify_tokens=8)  # a chain of k = 8
        engine.generate(requests[:2], policy)  # warm-up: compiles the kernels
        result = engine.generate(requests, policy)
        sd_iters = [it for it in result.iterations if it.accept_lens and not it.is_prefill]
        rows.append({
            "verify_impl": verify_impl, "attn_impl": attn_impl,
            "num_sd_iterations": len(sd_iters),
            "median_sd_iteration_ms": 1e3 * statistics.median(it.wall_s for it in sd_iters),
            "mean_accept_len": statistics.mean(a for it in sd_iters for a in it.accept_lens),
        })  # fmt: skip
    base = rows[0]["median_sd_iteration_ms"]
    for row in rows:
        row["speedup_vs_first"] = base / row["median_sd_iteration_ms"]
    return rows


def _format_table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Rows as the CLI's text table (tltsim.cli.table); columns are (key, title, format spec)."""
    titles = {key: title for key, title, _ in columns}
    formats = {key: fmt for key, _, fmt in columns}
    return format_table(rows, titles, formats, left=("kernel", "shape", "verify_impl", "attn_impl"))


KERNEL_COLUMNS = [
    ("kernel", "kernel", "s"), ("shape", "shape", "s"), ("ref_ms", "ref ms", ".3f"),
    ("sdpa_ms", "sdpa ms", ".3f"), ("triton_ms", "triton ms", ".3f"),
    ("speedup", "speedup", ".2f"), ("read_all_once_floor_ms", "floor ms", ".3f"),
    ("triton_over_floor", "x floor", ".2f"), ("achieved_GBps", "GB/s", ".0f"),
    ("pct_of_peak", "% peak", ".0f"), ("mean_accepted", "accepted", ".2f"),
]  # fmt: skip
ENGINE_COLUMNS = [
    ("verify_impl", "verify", "s"), ("attn_impl", "attention", "s"),
    ("num_sd_iterations", "SD iters", "d"), ("median_sd_iteration_ms", "median ms", ".2f"),
    ("mean_accept_len", "accept", ".2f"), ("speedup_vs_first", "speedup", ".2f"),
]  # fmt: skip


def parse_config(argv: list[str] | None) -> BenchConfig:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for field in dataclasses.fields(BenchConfig):
        if field.type in ("bool", bool):
            parser.add_argument(f"--{field.name}", action=argparse.BooleanOptionalAction,
                                default=field.default)  # fmt: skip
        else:
            kind = {"int": int, "str": str}[field.type if isinstance(field.type, str) else
                                            field.type.__name__]  # fmt: skip
            parser.add_argument(f"--{field.name}", type=kind, default=field.default)
    args = parser.parse_args(argv)
    try:
        return BenchConfig(**vars(args))
    except ValueError as err:
        print(f"bench_kernels: bad option: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA GPU (the Triton kernels are timed compiled, with CUDA "
              "events); none is available here, so nothing was measured.")  # fmt: skip
        return 0
    props = torch.cuda.get_device_properties(0)
    peak, source = peak_bandwidth(props)
    print(f"device: {props.name}; peak HBM bandwidth {peak / 1e12:.2f} TB/s ({source})")
    gen = torch.Generator(device="cuda").manual_seed(cfg.seed)
    kernel_rows = bench_spec_verify(cfg, peak, gen) + bench_tree_attention(cfg, peak, gen)
    for row in kernel_rows:
        row["pct_of_peak"] = 100 * row["achieved_GBps"] * 1e9 / peak
    print(_format_table(kernel_rows, KERNEL_COLUMNS))
    print(
        "floor ms: every probability / logit (spec_verify) or KV entry (tree_attention) read "
        "once at peak bandwidth; GB/s: bytes the kernel must read / kernel time."
    )
    engine_rows = bench_engine(cfg) if cfg.is_engine_measured else []
    if engine_rows and "note" in engine_rows[0]:
        print(engine_rows[0]["note"])
    elif engine_rows:
        print(_format_table(engine_rows, ENGINE_COLUMNS))
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(dataclasses.asdict(cfg), indent=2) + "\n")
    result = {"device": props.name, "peak_bytes_per_s": peak, "peak_source": source,
              "kernels": kernel_rows, "engine": engine_rows}  # fmt: skip
    (out_dir / "bench_kernels.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out_dir / 'bench_kernels.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

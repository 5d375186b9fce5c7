"""``TrainConfig``: the resolved settings of one ``tltrun train`` run (validated by
``config_checks.check_train_config``).

One frozen dataclass shared by the launcher (``tltrun.train.launch``), each worker process
(``tltrun.train.worker``) and the command line (``tltrun.cli.train``: one flag per field), so
the workers import their settings from here rather than from the module that spawns them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tltrun.model.attention import ATTN_IMPLS
from tltrun.model.history_drafter import HistoryConfig
from tltrun.rollout.engine_config import default_dtype
from tltrun.train.config_checks import BACKENDS, check_train_config
from tltsim.policy import POLICY_NAMES, is_eagle_drafting
from tltsim.policy.tlt_config import DRAFTER_EXPLORE

# Fields a resumed run may change without --override-config: where and how often it writes,
# how long it runs, and the resources it uses, none of which changes what a step computes
# (num_threads and poll_s change timing only: rounding of threaded reductions aside, and spot
# training's wall-clock dependence is already there). Every other field, and every TaskConfig
# field, changes the run (tltrun.train.launch refuses a resume that changes one).
RESUME_NEUTRAL_FIELDS = (
    "out",
    "num_steps",
    "checkpoint_every",
    "keep_checkpoints",
    "tensorboard",
    "num_threads",
    "poll_s",
    # out of the training path: reward parallelism, the rollout dump and evaluation (which
    # restores the engine's RNG and discards its harvest,
    # tltrun.train.responses.ResponseScorer.evaluate)
    "reward_processes",
    "dump_rollouts",
    "eval_every",
    "eval_max_prompts",
    "eval_num_samples",
)


@dataclass(frozen=True)
class TrainConfig:
    model_dir: str = field(
        default="",
        metadata={
            "help": "Hugging Face model directory (config.json + safetensors + tokenizer: "
            "a Qwen/Llama checkpoint, or `tltrun sft`'s) (required)",
            "metavar": "DIR",
        },
    )
    out: str = field(default="", metadata={"help": "output directory (required)", "metavar": "DIR"})
    drafter_dir: str | None = field(
        default=None,
        metadata={"help": "EAGLE drafter to start from (default: a fresh one)", "metavar": "DIR"},
    )
    num_workers: int = field(default=2, metadata={"help": "rollout worker processes"})
    num_steps: int = field(default=20, metadata={"help": "RL steps"})
    prompts_per_step: int = field(default=8, metadata={"help": "prompts per RL step"})
    # G; TLT's runs use 8-16 (sft.py's note), DeepSeekMath 64
    group_size: int = field(default=8, metadata={"help": "responses per prompt (GRPO group)"})
    # Cap per response: the default task's reference solutions reach 738 tokens at p99 and
    # 0.24% exceed 1024 (``tltrun task``), so 1024 truncates only the extreme tail.
    max_new_tokens: int = field(default=1024, metadata={"help": "token cap per response"})
    # GRPO samples from the policy itself (DeepSeekMath Sec. 4.1)
    temperature: float = field(default=1.0, metadata={"help": "rollout sampling temperature"})
    # GRPO's log-probabilities are of the untruncated distribution (tltrun.train.grpo): below 1
    # the rollout is no longer exactly on-policy
    top_p: float = field(
        default=1.0,
        metadata={"help": "rollout nucleus sampling mass (below 1: not exactly on-policy)"},
    )
    policy: str = field(
        default="tlt", metadata={"help": "SD policy of the rollouts", "choices": POLICY_NAMES}
    )
    static_strategy: str = field(
        default="4_1_4",
        metadata={"help": "the static policy's strategy DRAFTSTEPS_TOPK_VERIFYTOKENS"},
    )
    # TLTAdaptive's strategies (TLTConfig.strategies, one bucket each, buckets starting at
    # tlt_bucket_starts); () keeps TLT's public GPU defaults 8_4_48..8_4_8. On a CPU, verifying
    # a 48-node tree per request is compute-bound and costs more than it saves, so CPU runs
    # pass chain strategies (e.g. 4_1_4,3_1_3,2_1_2,1_1_1) — see benchmarks/bench_train.py.
    tlt_strategies: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "tlt/tltbase policy's strategies, one bucket each (default: the policy's)"
        },
    )
    tlt_bucket_starts: tuple[int, ...] = field(
        default=(),
        metadata={"help": "smallest batch size of each tlt/tltbase bucket (default: the policy's)"},
    )
    # TLTConfig.drafters: the drafters tlt's bandit may pick per bucket (issue #20)
    tlt_drafters: tuple[str, ...] = field(
        default=("eagle",),
        metadata={
            "help": "tlt: drafters its bandit chooses between per batch bucket (eagle, history)"
        },
    )
    # TLTConfig.history_strategies: the history drafter's arms in every bucket (its comment)
    tlt_history_strategies: tuple[str, ...] = field(
        default=(),
        metadata={
            "help": "tlt/tltbase: the history drafter's strategies in every bucket "
            "(default: each bucket's tlt strategies)"
        },
    )
    # TLTConfig.explore_iters (1: fastrl's per-iteration exploration; its comment)
    tlt_explore_iters: int = field(
        default=1,
        metadata={"help": "tlt/tltbase: iterations a bandit exploration holds its random arm"},
    )
    # TLTConfig.drafter_explore ("iteration": fastrl's rule for every arm; its comment)
    tlt_drafter_explore: str = field(
        default="iteration",
        metadata={
            "help": "tlt with two drafters: explore the other drafter's arms per iteration "
            "(fastrl's epsilon) or in an epsilon share of rollouts (rollout)",
            "choices": DRAFTER_EXPLORE,
        },
    )
    # TLTConfig.threshold (fastrl bs_threshold)
    tlt_threshold: int = field(
        default=32,
        metadata={"help": "tlt/tltbase: SD stays off while a worker has more active requests"},
    )
    # None: where the policy drafts with the EAGLE drafter (tlt, static), as the simulator
    # spot-trains; nospec and tltbase trained a drafter nothing used (and, with
    # --deterministic, each step waited for it)
    is_spot_training: bool | None = field(
        default=None,
        metadata={
            "help": "idle workers train the EAGLE drafter until the rollout ends, with >= 2 "
            "workers (default: where the policy drafts with it, tlt and static; not nospec "
            "and tltbase)"
        },
    )
    # Spot training's timing dependence (tltrun.train.spot, "Deterministic mode"): off by default
    # because the step then waits for the spot budgets (README, "Reproducible runs").
    is_deterministic: bool = field(
        default=False,
        metadata={
            "help": "same seed, same run: spot budgets from harvested tokens (the step waits "
            "for them) and tlt's bandit rewarded by a modelled iteration cost, not the clock"
        },
    )
    # SpotTrainerConfig.max_epochs (fastrl max_epochs)
    spot_max_epochs: int = field(
        default=10,
        metadata={"help": "passes over each spot trainer's harvested tokens per RL step at most"},
    )
    # EAGLE uses 3e-5 for 7B targets; small drafters need more
    drafter_lr: float = field(default=1e-3, metadata={"help": "drafter AdamW learning rate"})
    # EAGLE-1's bs
    drafter_batch_size: int = field(default=4, metadata={"help": "sequences per drafter update"})
    lr: float = field(default=1e-6, metadata={"help": "actor (GRPO) learning rate"})
    kl_coef: float = field(default=0.04, metadata={"help": "GRPO KL penalty coefficient"})
    num_epochs: int = field(default=1, metadata={"help": "GRPO passes over each step's rollouts"})
    checkpoint_every: int = field(default=5, metadata={"help": "write a checkpoint every N steps"})
    # 0 keeps every checkpoint, as veRL (trainer.max_actor_ckpt_to_keep: null) and Hugging Face
    # Trainer / TRL (TrainingArguments.save_total_limit: None) do by default. Each holds the
    # actor, its AdamW state and the drafter's: ~350 MB for bench_train's 22M-parameter CPU
    # model, ~16 bytes per parameter (~110 GB for a 7B actor), so a long run fills a disk unless
    # older ones go. Keep 2 or more to have a fallback when the newest is found damaged.
    keep_checkpoints: int = field(
        default=0, metadata={"help": "keep only the newest N checkpoints (0: keep all)"}
    )
    tensorboard: bool = field(
        default=False,
        metadata={"help": "also write log.jsonl's numbers as TensorBoard scalars (rank 0)"},
    )
    seed: int = field(default=0, metadata={"help": "seed of prompts, sampling, drafter and policy"})
    backend: str = field(
        default="torch", metadata={"help": "rollout backend of each worker", "choices": BACKENDS}
    )
    max_running_requests: int | None = field(
        default=None,
        metadata={"help": "requests a worker decodes together (default: its whole share)"},
    )
    prompt_split: tuple[int, ...] = field(
        default=(), metadata={"help": "prompts per worker (default: as even as possible)"}
    )
    # W workers on W cores
    num_threads: int = field(default=1, metadata={"help": "torch threads per worker"})
    poll_s: float = field(
        default=0.01,
        metadata={"help": "seconds between idle workers' checks for the rollout's end"},
    )
    # None: the rollout engine's device default (tltrun.rollout.engine_config.default_dtype),
    # issue #18's "bf16 on CUDA, fp32 stays the CPU default"; it was float32 on CUDA too
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "rollout weights/KV dtype (default: bfloat16 on CUDA, float32 elsewhere); "
            "bfloat16 on CUDA also trains the actor in bf16 autocast over fp32 master weights "
            "and optimizer state (CPU trains in fp32)"
        },
    )
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda"})
    # the torch engine's EngineConfig.compile_layers (issue #18 item 5; off by default)
    compile_layers: bool = field(
        default=False,
        metadata={"help": "torch engine: torch.compile each layer's work around attention"},
    )
    # the torch engine's EngineConfig.cuda_graphs off (issue #18: capture off with --eager) and
    # attn_impl, as generate and bench take them
    is_eager: bool = field(
        default=False,
        metadata={
            "help": "torch engine: every forward eagerly, no CUDA-graph pool (default: the pool "
            "on CUDA; CPU runs eagerly)"
        },
    )
    attn_impl: str | None = field(
        default=None,
        metadata={
            "help": "torch engine: attention, one of " + ", ".join(ATTN_IMPLS) + " (default: "
            "flex on CUDA, sdpa on CPU)"
        },
    )
    # the torch engine's EngineConfig.fuse_projections (off by default)
    fuse_projections: bool = field(
        default=False,
        metadata={
            "help": "torch engine: one GEMM for q, k and v and one for gate and up in rollout "
            "forwards"
        },
    )
    # the torch engine's EngineConfig.is_history_cross_prompt (tltrun.model.history_drafter)
    is_history_cross_prompt: bool = field(
        default=HistoryConfig.is_cross_prompt,
        metadata={"help": "torch engine: history drafts also from other prompts' responses"},
    )
    # ---- your data, reward and evaluation (issue #16; tltrun.data) ----------------------------
    data: str | None = field(
        default=None,
        metadata={
            "help": "prompts: a .jsonl/.json/.parquet/.csv file, a `datasets` directory, or "
            "reasoning-gym:<task> (default: the built-in task)",
            "metavar": "PATH",
        },
    )
    prompt_key: str = field(
        default="prompt",
        metadata={"help": "--data column holding the prompt (a string or chat messages)"},
    )
    # '' = the rows have no answer column (a preference or format reward): only a user's
    # file.py:function reward can score them, and it receives answer=None
    answer_key: str = field(
        default="answer",
        metadata={
            "help": "--data column the reward compares against ('' = none: a file.py:function "
            "reward then receives answer=None)"
        },
    )
    # reasoning-gym:<task> generates this many problems from the seed (no download)
    data_num_rows: int = field(
        default=10_000,
        metadata={"help": "reasoning-gym: problems generated from --seed (a file is read whole)"},
    )
    skip_bad_rows: bool = field(
        default=False,
        metadata={"help": "skip (and count) bad --data rows instead of stopping at the first"},
    )
    chat_template: bool = field(
        default=False,
        metadata={"help": "wrap plain-text prompts as a user message in the model's chat template"},
    )
    # Prompts longer than this are bad rows; the built-in task's are bounded by its chain length.
    max_prompt_tokens: int = field(
        default=1024, metadata={"help": "longest prompt in tokens (longer rows are bad rows)"}
    )
    reward: str = field(
        default="",
        metadata={
            "help": "builtin | math | exact | regex:PATTERN | reasoning-gym:<task> | "
            "file.py:function (default: builtin for the built-in task, reasoning-gym:<task> for "
            "such --data; required with a data file)"
        },
    )
    reward_timeout_s: float = field(
        default=10.0, metadata={"help": "seconds one reward call may take (then it scores 0)"}
    )
    reward_errors: str = field(
        default="zero",
        metadata={
            "help": "a reward that raises or times out: zero (log it, score 0) or raise (stop)",
            "choices": ("zero", "raise"),
        },
    )
    reward_processes: int = field(
        default=1, metadata={"help": "reward processes per worker (rewards run out of process)"}
    )
    # DAPO's overlong reward shaping (arXiv 2503.14476, Sec. 3.4); 0 = off
    overlong_buffer_tokens: int = field(
        default=0,
        metadata={"help": "penalise responses within this many tokens of the cap (DAPO; 0: off)"},
    )
    overlong_penalty: float = field(
        default=1.0, metadata={"help": "reward subtracted at the cap, linear over the buffer"}
    )
    format_penalty: float = field(
        default=0.0,
        metadata={"help": "subtracted when a response lacks the reward's answer form (0: off)"},
    )
    eval_data: str | None = field(
        default=None,
        metadata={"help": "held-out prompts (same formats as --data)", "metavar": "PATH"},
    )
    eval_split: float = field(
        default=0.0,
        metadata={"help": "hold out this fraction of --data for evaluation instead"},
    )
    eval_every: int = field(
        default=0, metadata={"help": "evaluate every N steps and after the last (0: never)"}
    )
    eval_max_prompts: int = field(
        default=64,
        metadata={"help": "evaluation prompts per evaluation at most (the first N rows)"},
    )
    eval_num_samples: int = field(
        default=1,
        metadata={"help": "responses per eval prompt: 1 = greedy, more = sampled at temperature"},
    )
    # FSDP2 (tltrun.train.fsdp): 1 keeps a full actor + AdamW state on every rank (data
    # parallel); the world size shards them over all ranks (1/W each)
    fsdp_size: int = field(
        default=1,
        metadata={
            "help": "ranks the actor, its gradients and AdamW state are sharded over with "
            "FSDP2: 1 (replicated) or the number of workers"
        },
    )
    gradient_checkpointing: bool = field(
        default=False,
        metadata={
            "help": "recompute activations in the backward pass (less memory, ~1.3x compute)"
        },
    )
    max_tokens_per_microbatch: int = field(
        default=8192,
        metadata={"help": "padded tokens per GRPO forward/backward (gradients accumulate)"},
    )
    dump_rollouts: bool = field(
        default=True, metadata={"help": "write every step's responses to rollouts/step_N.jsonl"}
    )

    def policy_settings(self) -> dict:
        """``tltsim.policy.make_policy`` keyword arguments of this run's policy."""
        if self.policy == "static":
            return {"strategy": self.static_strategy}
        if self.policy not in ("tlt", "tltbase"):  # TLTBase takes TLTConfig's fields too
            return {}
        settings: dict = {"threshold": self.tlt_threshold}
        if self.tlt_strategies:
            settings["strategies"] = tuple(self.tlt_strategies)
        if self.tlt_bucket_starts:
            settings["bucket_starts"] = tuple(self.tlt_bucket_starts)
        if self.policy == "tlt" and tuple(self.tlt_drafters) != ("eagle",):
            settings["drafters"] = tuple(self.tlt_drafters)
        if self.tlt_history_strategies:
            settings["history_strategies"] = tuple(self.tlt_history_strategies)
        if self.tlt_explore_iters != 1:
            settings["explore_iters"] = self.tlt_explore_iters
        if self.policy == "tlt" and self.tlt_drafter_explore != "iteration":
            settings["drafter_explore"] = self.tlt_drafter_explore
        return settings

    def worker_seed(self, rank: int, stream: int = 0) -> int:
        """Rank ``rank``'s seed of one random stream (0: the rollout engine's sampling, 500: the
        spot trainer's batches and noise): ``seed * 1000 + stream + rank``, folded into torch's
        int64 seed range (a ``--seed`` near 2^63 overflowed it and stopped every worker)."""
        return (self.seed * 1000 + stream + rank) % 2**63

    @property
    def is_spot_harvesting(self) -> bool:
        """Whether idle workers spot-train the EAGLE drafter: an idle worker possible (>= 2
        workers) and ``is_spot_training``, by default where the policy drafts with it (nospec and
        tltbase do not: they trained a drafter nothing used, and the simulator never spot-trains
        them)."""
        if self.num_workers < 2:
            return False
        if self.is_spot_training is not None:
            return self.is_spot_training
        return is_eagle_drafting(self.policy, self.tlt_drafters, self.static_strategy)

    @property
    def dtype_name(self) -> str:
        """The rollout dtype: ``dtype``, else bfloat16 on CUDA and float32 elsewhere (as the
        engine's ``default_dtype``; config.json records this resolved name)."""
        return self.dtype if self.dtype is not None else default_dtype(self.device)

    @property
    def is_history_drafting(self) -> bool:
        """Whether the policy may draft from the rollout history (issue #20)."""
        return self.policy == "tltbase" or (self.policy == "tlt" and "history" in self.tlt_drafters)

    def __post_init__(self) -> None:
        check_train_config(self)

    def engine_settings(self) -> dict[str, Any]:
        """The torch engine's ``EngineConfig`` fields this run sets (the rest are per worker)."""
        return {
            "compile_layers": self.compile_layers,
            "fuse_projections": self.fuse_projections,
            "cuda_graphs": False if self.is_eager else None,  # None: the pool on CUDA
            "attn_impl": self.attn_impl,
            "is_history_cross_prompt": self.is_history_cross_prompt,
        }

    @property
    def reward_name(self) -> str:
        """The reward spec, defaults resolved (see the ``reward`` field)."""
        if self.reward:
            return self.reward
        if self.data and self.data.startswith("reasoning-gym:"):
            return "reasoning-gym:" + self.data.removeprefix("reasoning-gym:").split("?")[0]
        return "builtin"

    @property
    def is_user_reward(self) -> bool:
        """Whether the reward is the user's ``file.py:function``."""
        from tltrun.data.rewards import is_python_reward

        return is_python_reward(self.reward)

    @property
    def is_builtin_task(self) -> bool:
        return self.data is None

    def shares(self) -> list[tuple[int, int]]:
        """(first prompt index, number of prompts) of each worker."""
        counts = list(self.prompt_split) or [
            self.prompts_per_step // self.num_workers
            + (r < self.prompts_per_step % self.num_workers)
            for r in range(self.num_workers)
        ]
        starts = [sum(counts[:r]) for r in range(self.num_workers)]
        return list(zip(starts, counts, strict=True))

    def max_running(self, count: int) -> int:
        """The engine's request slots on a worker of ``count`` prompts: --max-running-requests,
        never more than the worker's responses (each slot is preallocated KV cache: 10^12
        tried to allocate 36 PB and failed as a worker's internal error)."""
        responses = count * self.group_size
        return min(self.max_running_requests or responses, responses)

"""``tltrun train-drafter``: train an EAGLE drafter on the target's own generations (the
``generations.jsonl`` that ``tltrun generate`` writes), exported in vLLM's layout.

    tltrun train-drafter --model DIR --data DIR/generations.jsonl --out DIR [--train-num-steps N]
    tltrun train-drafter --out DIR --resume       # continue a killed run with its settings

Flags map 1:1 onto ``TrainDrafterConfig`` and ``DrafterTrainConfig`` (``--train-*``). It writes
``train_config.json`` when it starts (a ``--resume`` runs with it) and, at the end, the drafter
and ``history.json``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path

from tltrun.cli.args import config_dict, offline_configs_from_args, stop_says_how_to_resume
from tltrun.model.config import check_device, read_config
from tltrun.rollout.engine_config import DTYPES, default_dtype
from tltsim.cli.args import add_dataclass_args, check_out_dir
from tltsim.errors import UsageError
from tltsim.jsonio import parse_json, read_text, write_json


@dataclass(frozen=True)
class TrainDrafterConfig:
    model: str = field(
        default="", metadata={"help": "target model directory (required)", "metavar": "DIR"}
    )
    data: str = field(
        default="",
        metadata={
            "help": "generations.jsonl written by `tltrun generate` (required)",
            "metavar": "PATH",
        },
    )
    out: str = field(
        default="",
        metadata={"help": "output directory of the exported drafter (required)", "metavar": "DIR"},
    )
    init: str = field(
        default="",
        metadata={"help": "start from this drafter directory, not a fresh one", "metavar": "DIR"},
    )
    device: str = field(default="cpu", metadata={"help": "torch device, e.g. cpu or cuda"})
    # None: the rollout engine's device default (default_dtype), the hidden states the drafter
    # then drafts from; it was float32 on CUDA too
    dtype: str | None = field(
        default=None,
        metadata={
            "help": "dtype of the target (default: bfloat16 on CUDA, float32 elsewhere; the "
            "drafter trains on fp32 master weights)",
            "choices": tuple(DTYPES),
        },
    )
    # The resumable state (tltrun.train.resumable: drafter + AdamW, 12 bytes per fp32
    # parameter) of the README's 8-layer hidden-256 SFT model's drafter is 10 MB and took 22 ms
    # to write and fsync on this machine, against ~7 s for its 100 steps (batch 4): ~0.3%. A 7B
    # target's drafter (a ~0.2B-parameter layer) writes ~3 GB a time: raise N there.
    checkpoint_every: int = field(
        default=100,
        metadata={"help": "write the state --resume continues from every N steps (0: never)"},
    )

    def __post_init__(self) -> None:
        for name in ("model", "data", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if not 0 <= self.checkpoint_every < 2**31:
            raise ValueError(f"checkpoint_every must be in [0, 2^31), got {self.checkpoint_every}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype {self.dtype!r}: expected one of {', '.join(DTYPES)}")
        check_device(self.device)

    @property
    def dtype_name(self) -> str:
        """The target's dtype: ``dtype``, else the engine's default for the device."""
        return self.dtype if self.dtype is not None else default_dtype(self.device)


def cmd_train_drafter(args: argparse.Namespace) -> int:
    from tltrun.train.drafter_training import DrafterTrainConfig
    from tltrun.train.state import RunLock

    configs = offline_configs_from_args(
        args,
        {"train_drafter": (TrainDrafterConfig, ""), "train": (DrafterTrainConfig, "train-")},
        command="tltrun train-drafter",
        config_file="train_config.json",
        finished_file="history.json",
    )
    if configs is None:
        print(f"{args.out}: the run already finished (history.json is written); nothing to resume")
        return 0
    cfg, train_cfg = configs["train_drafter"], configs["train"]
    for flag in ("model", "init"):  # the export would replace that model with the drafter
        given = getattr(cfg, flag)
        if given and Path(given).resolve() == Path(cfg.out).resolve():
            raise UsageError(f"--out {cfg.out} is the --{flag} directory; choose another --out")
    out = Path(args.out) if args.resume else check_out_dir(cfg.out)
    with RunLock(out, "tltrun train-drafter"), stop_says_how_to_resume(out, "tltrun train-drafter"):
        return _train_drafter(cfg, train_cfg, out, args.resume)


def _train_drafter(cfg: TrainDrafterConfig, train_cfg, out: Path, is_resume: bool) -> int:
    import torch

    from tltrun.model.drafter import EagleDrafter, export_vllm, load_drafter, trainable_copy
    from tltrun.model.hf_checkpoint import checkpoint_digest, load_hf
    from tltrun.train import resumable
    from tltrun.train.drafter_training import records_from_outputs, train_drafter

    # the data first, against the model's config: a refusal after start_fresh had deleted the
    # earlier drafter in --out (and loaded the whole target first)
    _check_same_vocabulary(cfg.data, cfg.model)
    model_cfg = read_config(cfg.model)
    sequences = _read_generations(cfg.data, model_cfg.vocab_size, model_cfg.max_position_embeddings)
    if not is_resume:
        resumable.start_fresh(out, "tltrun train-drafter", config_file="train_config.json")
        # the dtype the device decided where --dtype was left out ("resolved", as generate's)
        recorded = config_dict(train_drafter=cfg, train=train_cfg)
        write_json(out / "train_config.json", {**recorded, "resolved": {"dtype": cfg.dtype_name}})
    target = load_hf(cfg.model, dtype=DTYPES[cfg.dtype_name], device=cfg.device)
    drafter = trainable_copy(
        load_drafter(cfg.init, target, dtype=torch.float32)  # no round trip through --dtype
        if cfg.init
        else EagleDrafter.for_target(target, seed=train_cfg.seed),
        target,
    )
    records = records_from_outputs(target, sequences)
    checkpoints = resumable.Checkpointing(
        out=out, command="tltrun train-drafter", every=cfg.checkpoint_every, is_resume=is_resume
    )
    history = train_drafter(
        drafter,
        records,
        train_cfg,
        checkpointing=checkpoints,
        target_sha256=checkpoint_digest(cfg.model),
    )
    tail = history[-min(len(history), 20) :] if history else [{}]
    final = {k: sum(h[k] for h in tail) / len(tail) for k in tail[0]}
    export_vllm(
        drafter,
        out,
        meta={
            "num_train_steps": train_cfg.num_steps,
            "num_sequences": len(records),
            "final": final,
        },
    )
    write_json(out / "history.json", history)
    resumable.finish(out)
    if history:
        # (mean of the last 20 steps, or of all: "last 20" of a 2-step run said what was not)
        last = f"last {len(tail)}" if len(tail) < len(history) else f"all {len(tail)}"
        how = (f"for {train_cfg.num_steps} steps ({last}: loss {final['loss']:.3f}, top-1 "
               f"agreement {final['top1']:.3f})")  # fmt: skip
    else:  # (it printed "loss 0.000, top-1 agreement 0.000" for a drafter never trained)
        how = "for no steps (--train-num-steps 0: the initial drafter)"
    print(f"drafter trained on {len(records)} sequences {how}; exported to {out}")
    return 0


# the files that say what a token id means: a model's tokenizer.json, a byte-level BPE's
# vocab.json, a sentencepiece model (merges.txt only says how text splits, not what an id is)
VOCABULARY_FILES = ("tokenizer.json", "vocab.json", "tokenizer.model")


def _check_same_vocabulary(data: str, model: str) -> None:
    """Generations written by ``tltrun generate`` (its config.json beside them names the model)
    with another tokenizer than ``--model``'s: their ids are other tokens, and the drafter
    trained on the target's hidden states of meaningless sequences (ids that merely fell
    inside the vocabulary passed). What is compared is each id's token, not the files' bytes:
    the same vocabulary re-saved (another indentation, another version of ``tokenizers``) is
    the same."""
    recorded = Path(data).parent / "config.json"
    try:
        source = json.loads(recorded.read_text())["generate"]["model"]
    except (OSError, ValueError, KeyError, TypeError):
        return  # not generate's output: nothing recorded to compare with
    if not isinstance(source, str) or not Path(source).is_dir():
        return  # moved since: nothing to compare with
    for name in VOCABULARY_FILES:
        theirs, ours = Path(source) / name, Path(model) / name
        if not (theirs.is_file() and ours.is_file()):
            continue
        # the id map was compared (tokenizer.json on both sides): a sentencepiece file
        # re-serialised with the same vocabulary differs in bytes only (review)
        is_json_compared = all((Path(d) / "tokenizer.json").is_file() for d in (source, model))
        if name == "tokenizer.model" and is_json_compared:
            continue
        if _id_tokens(theirs) != _id_tokens(ours):
            raise UsageError(
                f"--data {data}: generated by {source} (its {recorded.name}), whose {name} "
                f"differs from --model {model}'s: its token ids are other tokens"
            )


def _id_tokens(path: Path) -> object:
    """What each token id of ``path`` means, as something to compare: the id -> token map of a
    tokenizer.json (added tokens included) or a vocab.json; a file that does not parse so (and
    a sentencepiece model) as its bytes."""
    if path.name == "tokenizer.json":
        from tokenizers import Tokenizer

        try:
            return Tokenizer.from_file(str(path)).get_vocab(with_added_tokens=True)
        except Exception:  # noqa: BLE001 - tokenizers raises bare Exceptions; compared as bytes
            return path.read_bytes()
    if path.name == "vocab.json":
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError):
            return path.read_bytes()
    return path.read_bytes()


def _read_generations(
    path: str, vocab_size: int, max_positions: int
) -> list[tuple[list[int], int]]:
    out = []
    # split at "\n" only (a raw U+2028 inside a string is JSON: generate.read_prompts)
    for lineno, line in enumerate(read_text(path, "generations file").split("\n"), start=1):
        if not line.strip():
            continue
        obj = parse_json(line, f"{path} line {lineno}")
        try:
            prompt, output = obj["prompt_token_ids"], obj["output_token_ids"]
        except (KeyError, TypeError):
            raise UsageError(
                f"{path} line {lineno}: expected JSON with 'prompt_token_ids' and 'output_token_ids'"
            ) from None
        if not all(
            isinstance(x, list) and all(type(t) is int for t in x) for x in (prompt, output)
        ):
            raise UsageError(
                f"{path} line {lineno}: 'prompt_token_ids' and 'output_token_ids' must be lists of ints"
            )
        if not output:  # no pair of it would be trained (make_batch's loss mask)
            raise UsageError(
                f"{path} line {lineno}: 'output_token_ids' is empty: nothing to train on"
            )
        ids = list(prompt) + list(output)
        if len(ids) < 3 or min(ids) < 0 or max(ids) >= vocab_size:
            raise UsageError(f"{path} line {lineno}: need >= 3 tokens, all in [0, {vocab_size})")
        if len(ids) > max_positions:  # (trained silently at positions the model never had)
            raise UsageError(
                f"{path} line {lineno}: {len(ids)} tokens, beyond the model's "
                f"max_position_embeddings ({max_positions})"
            )
        out.append((ids, len(prompt)))
    if not out:
        raise UsageError(f"--data {path}: no generations")
    return out


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltrun train-drafter``."""
    from tltrun.train.drafter_training import DrafterTrainConfig

    train = subparsers.add_parser(
        "train-drafter", help="train an EAGLE drafter on the target's own generations"
    )
    train.add_argument(
        "--resume",
        action="store_true",
        help="continue the killed run in --out from its last state, with its train_config.json",
    )
    add_dataclass_args(train, TrainDrafterConfig)
    add_dataclass_args(train, DrafterTrainConfig, prefix="train-")
    train.set_defaults(func=cmd_train_drafter)

"""``tltrun generate``: roll out prompts with the torch engine (optionally with SD); its
``generations.jsonl`` is what ``tltrun train-drafter`` (``tltrun.cli.train_drafter``) trains on.

    tltrun generate --model DIR --prompts FILE.jsonl --out DIR [--drafter DIR] [--policy tlt]
    tltrun generate --out DIR --resume          # continue a killed run with its config.json

Flags map 1:1 onto ``GenerateConfig``, ``EngineConfig`` and ``SamplingParams``
(``tltrun.cli.args``).

Prompt file (JSONL, one object per line): ``{"id": "p0", "prompt_token_ids": [...]}``,
``{"id": "p0", "prompt": "text"}`` or ``{"id": "p0", "prompt": [chat messages]}``, tokenized as
``tltrun train`` tokenizes its prompts (``tltrun.data.tokenizer``: the model directory's
tokenizer, its chat template for messages, and for text with ``--chat-template``), optionally
``"max_new_tokens": N``. ``generate`` writes ``config.json`` when
it starts, ``generations.jsonl`` as the responses finish (``tltrun.cli.generations_log``: a
killed run keeps them, and ``--resume`` generates only the others), and at the end
``trace.json`` (a measured tlt-trace step of what this process rolled out), which marks the run
finished. A progress bar counts the finished responses.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import warnings
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tltrun.cli.args import (
    add_engine_args,
    check_kv_cache_fits,
    check_same_weights,
    engine_config_from_args,
    engine_defaults,
    recorded_engine_run,
    run_config_dict,
    stop_says_how_to_resume,
    weights_digests,
)
from tltrun.cli.generations_log import GenerationsLog
from tltrun.data.dataset import checked_prompt
from tltrun.data.tokenizer import load_tokenizer
from tltrun.rollout.engine_config import DTYPES
from tltrun.rollout.interface import Request
from tltrun.train.config_checks import absolute_paths
from tltsim.cli.args import add_dataclass_args, check_out_dir, dataclass_from_args
from tltsim.errors import UsageError
from tltsim.jsonio import parse_json, read_json, read_text, write_json
from tltsim.policy import POLICY_NAMES, StaticSpec, is_eagle_drafting
from tltsim.policy.tlt_config import TLTConfig
from tltsim.trace.schema import MAX_COUNT

# Most requests (prompt lines x group size) one ``generate`` builds: vLLM's max_num_seqs default
# (256) times 4096 waves; --group-size 10^9 spent minutes building request objects, never ran.
MAX_REQUESTS = 2**20


class PromptWarning(UserWarning):
    """A legal but suspicious prompt (empty, or characters the tokenizer maps to <unk>)."""


@dataclass(frozen=True)
class GenerateConfig:
    model: str = field(
        default="", metadata={"help": "Hugging Face model directory (required)", "metavar": "DIR"}
    )
    prompts: str = field(
        default="", metadata={"help": "JSONL prompt file (required)", "metavar": "PATH"}
    )
    out: str = field(default="", metadata={"help": "output directory (required)", "metavar": "DIR"})
    drafter: str = field(
        default="",
        metadata={"help": "exported drafter directory (SD policies need it)", "metavar": "DIR"},
    )
    policy: str = field(
        default="nospec", metadata={"help": "SD policy (tltsim.policy)", "choices": POLICY_NAMES}
    )
    strategy: str | None = field(
        default=None,
        metadata={
            "help": "the static policy's strategy DRAFTSTEPS_TOPK_VERIFYTOKENS (default: "
            "tltsim's StaticSpec's, 8_4_32)"
        },
    )
    max_new_tokens: int | None = field(
        default=None, metadata={"help": "token cap of prompts that name none themselves"}
    )
    group_size: int = field(
        default=1, metadata={"help": 'responses per prompt (request ids "prompt_id/i")'}
    )
    step: int = field(default=0, metadata={"help": "RL step recorded in the trace"})
    chat_template: bool = field(
        default=False,
        metadata={"help": "wrap plain-text prompts as a user message in the model's chat template"},
    )

    def __post_init__(self) -> None:
        for name in ("model", "prompts", "out"):
            if not getattr(self, name):
                raise ValueError(f"--{name} is required")
        if self.group_size < 1 or (self.max_new_tokens is not None and self.max_new_tokens < 1):
            raise ValueError("group_size and max_new_tokens must be >= 1")
        if self.group_size > MAX_REQUESTS:
            raise ValueError(f"group_size must be <= {MAX_REQUESTS}, got {self.group_size}")
        if not 0 <= self.step <= MAX_COUNT:  # the trace format's bound on step numbers
            raise ValueError(f"step must be in [0, {MAX_COUNT}], got {self.step}")
        if self.strategy is not None:  # checked whatever the policy ('zz' ran as nospec)
            StaticSpec(strategy=self.strategy)


def _model_tokenizer(model_dir: str, is_chat_template: bool) -> Any:
    """The model's tokenizer; a directory that is no model (a hub cache's root) said as such,
    as ``tltrun train`` says it, not as a missing tokenizer.json."""
    from tltrun.model.config import read_config

    read_config(model_dir)
    return load_tokenizer(model_dir, is_chat_template=is_chat_template)


def read_prompts(path: str, model_dir: str, cfg: GenerateConfig) -> tuple[list[Request], Any]:
    """Requests (``group_size`` per prompt line) and the tokenizer if text prompts were used.
    A legal but suspicious text prompt (empty, or with characters the tokenizer maps to
    ``<unk>``) is generated anyway, with one ``PromptWarning`` counting them all."""
    # (read_text says what is wrong with a path that cannot be opened)
    with contextlib.suppress(OSError), open(path, "rb") as fh:
        if fh.read(4) == b"PAR1":  # (it said "not a text prompt file ... binary?")
            raise UsageError(
                f"--prompts {path}: a Parquet file; tltrun generate reads JSON lines (an "
                "object per line: 'id' and 'prompt' or 'prompt_token_ids'): convert it, e.g. "
                "pandas.read_parquet(path).to_json(out, orient='records', lines=True)"
            )
    tokenizer = None
    requests = []
    num_empty = num_with_unk = num_unk_chars = 0
    line_of_id: dict[str, int] = {}
    # split at "\n" only: str.splitlines also splits at U+2028, U+0085, ..., which
    # json.dumps(ensure_ascii=False) writes raw inside a string
    for lineno, line in enumerate(read_text(path, "prompt file").split("\n"), start=1):
        if not line.strip():
            continue
        where = f"{path} line {lineno}"
        obj = parse_json(line, where)
        if not isinstance(obj, dict) or "id" not in obj:
            raise UsageError(f"{where}: expected an object with an 'id' field")
        if not isinstance(obj["id"], (str, int)) or isinstance(obj["id"], bool):
            raise UsageError(f"{where}: 'id' must be a string or an integer, got {obj['id']!r}")
        if str(obj["id"]) in line_of_id:  # (the engine refused it naming neither file nor line)
            raise UsageError(
                f"{where}: 'id' {obj['id']!r} repeats line {line_of_id[str(obj['id'])]}'s"
            )
        line_of_id[str(obj["id"])] = lineno
        if "prompt_token_ids" in obj:
            ids = obj["prompt_token_ids"]
            if not isinstance(ids, list) or not ids or not all(type(t) is int for t in ids):
                raise UsageError(f"{where}: 'prompt_token_ids' must be a non-empty list of ints")
        elif "prompt" in obj:
            prompt = obj["prompt"]
            if not isinstance(prompt, str):  # (an empty string is legal here: BOS, warned)
                # a data row's rule: str(123), str(["x"]), a None content or an int role were
                # generated as text
                prompt = checked_prompt(prompt, "prompt", where)
            tokenizer = tokenizer or _model_tokenizer(model_dir, cfg.chat_template)
            try:
                ids = tokenizer.encode_prompt(prompt)
            except UsageError as err:  # the chat template refused it, or there is none
                raise UsageError(f"{where}: {err}") from None
            if not ids:  # (warned as legal, then refused by the engine without a place)
                raise UsageError(
                    f"{where}: 'prompt' is empty and the tokenizer adds no BOS: no token to "
                    "start from"
                )
            unk_id = tokenizer.hf.unk_token_id
            num_unk = ids.count(unk_id) if unk_id is not None else 0
            num_empty += not prompt
            num_with_unk += num_unk > 0
            num_unk_chars += num_unk
        else:
            raise UsageError(f"{where}: needs 'prompt_token_ids' or 'prompt'")
        max_new = obj.get("max_new_tokens", cfg.max_new_tokens)
        if "max_new_tokens" in obj and (type(max_new) is not int or max_new < 1):
            raise UsageError(f"{where}: 'max_new_tokens' must be an integer >= 1, got {max_new!r}")
        if max_new is None:
            raise UsageError(f"{where}: no 'max_new_tokens' (and no --max-new-tokens given)")
        if (len(requests) + cfg.group_size) > MAX_REQUESTS:
            raise UsageError(
                f"--prompts {path}: more than {MAX_REQUESTS} requests (prompts x --group-size)"
            )
        for i in range(cfg.group_size):
            # the prompts file's id keys the history drafter's index (issue #20)
            requests.append(
                Request(f"{obj['id']}/{i}", tuple(ids), max_new, prompt_id=str(obj["id"]))
            )
    if not requests:
        raise UsageError(f"--prompts {path}: no prompts")
    if num_empty or num_with_unk:
        warnings.warn(
            f"--prompts {path}: {num_empty} empty prompt(s); {num_with_unk} prompt(s) with "
            f"{num_unk_chars} character(s) outside the tokenizer's alphabet, encoded as <unk>",
            PromptWarning,
            stacklevel=2,
        )
    return requests, tokenizer


def cmd_generate(args: argparse.Namespace) -> int:
    from tltrun.train.resumable import refuse_other_results
    from tltrun.train.state import RunLock

    if args.resume:
        configs = recorded_engine_run(
            args,
            command="tltrun generate",
            section="generate",
            cls=GenerateConfig,
            finished_file="trace.json",
        )
        if configs is None:
            print(
                f"{args.out}: the run already finished (trace.json is written); nothing to resume"
            )
            return 0
        cfg, engine_cfg = configs
        out = Path(args.out)  # where the run is now (its config names where it started)
        # first: another model (a tokenizer too) was blamed on --prompts ("its requests changed")
        check_same_weights(out, cfg.model, cfg.drafter)
        requests, tokenizer = read_prompts(cfg.prompts, cfg.model, cfg)
        recorded = read_json(out / "config.json", "run config").get("requests_sha256")
        if recorded is not None and recorded != requests_sha256(requests):
            raise UsageError(  # (only the answered prompts' rows were compared)
                f"--prompts {cfg.prompts}: its requests changed since the run started (a "
                "prompt, a max_new_tokens or the lines); restore it, or start a new run"
            )
    else:
        cfg = absolute_paths(dataclass_from_args(GenerateConfig, args))  # resumable from anywhere
        if cfg.strategy is not None and cfg.policy != "static":  # (it was ignored)
            raise UsageError(
                f"--strategy {cfg.strategy}: only --policy static takes a strategy; "
                f"--policy {cfg.policy} chooses its own"
            )
        if cfg.drafter and not is_eagle_drafting(
            cfg.policy, TLTConfig().drafters, cfg.strategy or StaticSpec().decision.strategy
        ):  # (loaded and never used, unsaid)
            raise UsageError(
                f"--drafter {cfg.drafter}: --policy {cfg.policy} never drafts with it; drop it, "
                "or choose a policy that does (static, tlt)"
            )
        out = check_out_dir(cfg.out)
        refuse_other_results(out, "tltrun generate")
        requests, tokenizer = read_prompts(cfg.prompts, cfg.model, cfg)
        longest = max(len(r.prompt_token_ids) + r.max_new_tokens for r in requests)
        engine_cfg = engine_config_from_args(
            args, defaults=engine_defaults(cfg.model, len(requests), longest)
        )
        _check_requests_fit(requests, engine_cfg.max_model_len, cfg, args.max_model_len)
    check_kv_cache_fits(cfg.model, engine_cfg)
    with (
        RunLock(out, "tltrun generate"),
        stop_says_how_to_resume(out, "tltrun generate", is_resumable_anytime=True),
    ):
        log = GenerationsLog(out / "generations.jsonl", tokenizer)
        if args.resume:
            done = log.resume(requests)
            # new samples for the rest: the run's seed again drew the very numbers the
            # finished responses were drawn with (4 of a group's 16 samples came out twice)
            engine_cfg = replace(engine_cfg, seed=resume_seed(engine_cfg.seed, len(done)))
        else:
            if (out / "generations.jsonl").is_file() and not (out / "trace.json").is_file():
                raise UsageError(
                    f"{out}: holds the responses of an unfinished generate run (generations."
                    "jsonl, no trace.json); pass --resume to continue it, or choose another --out"
                )
            done = set()
        # the policy, drafter and engine are checked before the run writes anything: a refusal
        # here left config.json and an empty generations.jsonl, which then refused the corrected
        # command ("an unfinished generate run") and whose --resume repeated the refusal
        remaining = [r for r in requests if r.id not in done]
        engine = _start_engine(cfg, engine_cfg, remaining)
        if not args.resume:
            (out / "trace.json").unlink(missing_ok=True)  # a killed rerun is not "finished"
            write_json(
                out / "config.json",
                {
                    **run_config_dict(generate=cfg, engine=engine_cfg),
                    "requests_sha256": requests_sha256(requests),
                    **weights_digests(cfg.model, cfg.drafter),
                },
            )
            log.start()
        try:
            return _generate(cfg, engine_cfg, engine, requests, log, done, out)
        finally:
            log.close()


def _accept_text(mean_accept_len: float) -> str:
    """The mean accept length where SD ran (0 means it never verified: "0.00" read as a
    drafter that never hit)."""
    return f", mean accept length {mean_accept_len:.2f}" if mean_accept_len > 0 else ", no SD"


def _check_requests_fit(
    requests: list[Request], max_model_len: int, cfg: GenerateConfig, given: int | None
) -> None:
    """A request longer than the engine's context, named by its prompt's id and the limit's
    source (the engine's refusal named neither the file nor the flag: "request 'b/0': prompt +
    max_new_tokens = 604 exceeds max_model_len=512")."""
    for r in requests:
        total = len(r.prompt_token_ids) + r.max_new_tokens
        if total <= max_model_len:
            continue
        limit = (
            f"--max-model-len {given}"
            if given is not None
            else f"the model's {max_model_len} positions (max_position_embeddings, "
            f"{Path(cfg.model) / 'config.json'})"
        )
        raise UsageError(
            f"--prompts {cfg.prompts}: prompt {r.prompt_id!r}: {len(r.prompt_token_ids)} prompt "
            f"tokens + max_new_tokens {r.max_new_tokens} = {total} exceed {limit}; shorten it or "
            "lower its max_new_tokens (--max-new-tokens)"
        )


def requests_sha256(requests: list[Request]) -> str:
    """A fingerprint of a run's requests, in order: ids, prompt ids and token caps."""
    digest = hashlib.sha256()
    for r in requests:
        digest.update(json.dumps([r.id, list(r.prompt_token_ids), r.max_new_tokens]).encode())
    return digest.hexdigest()


def resume_seed(seed: int, num_done: int) -> int:
    """The sampling seed of a resume that finds ``num_done`` responses written: another stream
    than the run's (and than an earlier resume's, which had fewer) from the same seed."""
    digest = hashlib.sha256(f"tltrun generate resume {seed} {num_done}".encode()).digest()
    return int.from_bytes(digest[:8], "big") >> 11  # [0, 2^53): the trace's JSON-safe ints


def _policy_settings(cfg: GenerateConfig) -> dict[str, Any]:
    return {"strategy": cfg.strategy} if cfg.policy == "static" and cfg.strategy else {}


def _start_engine(cfg: GenerateConfig, engine_cfg, remaining: list[Request]):
    """The engine, with the rollout of ``remaining`` started (a UsageError for a policy,
    drafter or request it cannot run)."""
    from tltrun.model.drafter import load_drafter
    from tltrun.model.hf_checkpoint import load_hf
    from tltrun.rollout.engine import RolloutEngine
    from tltsim.policy import make_policy

    target = load_hf(cfg.model, dtype=DTYPES[engine_cfg.dtype_name], device=engine_cfg.device)
    drafter = load_drafter(cfg.drafter, target) if cfg.drafter else None
    try:
        policy = make_policy(cfg.policy, seed=engine_cfg.seed, **_policy_settings(cfg))
        engine = RolloutEngine(target, drafter, engine_cfg)
        engine.start_rollout(remaining, policy, step=cfg.step)
    except ValueError as err:
        raise UsageError(str(err)) from None
    return engine


def _generate(
    cfg: GenerateConfig, engine_cfg, engine, requests, log, done: set[str], out: Path
) -> int:
    """Run the started rollout of the requests not in ``done``, streaming each finished
    response to ``log``; then the ordered generations and the measured trace of this
    process's rollout."""
    from tqdm import tqdm

    from tltrun.rollout.measured_trace import hardware_name, measured_step
    from tltsim.trace.files import save_trace
    from tltsim.trace.schema import Trace

    remaining = [r for r in requests if r.id not in done]
    settings = _policy_settings(cfg)
    num_streamed = 0
    with tqdm(
        total=len(requests), initial=len(done), desc="tltrun generate", unit="response"
    ) as bar:
        while not engine.is_rollout_done:
            try:  # a decision the engine cannot run, of a policy start_rollout could not check
                engine.step()
            except ValueError as err:
                raise UsageError(str(err)) from None
            new = engine.scheduler.finished[num_streamed:]
            log.append([seq.to_output() for seq in new])
            num_streamed += len(new)
            bar.update(len(new))
    result = engine.finish_rollout()
    log.finish([r.id for r in requests])
    meta = {"source": f"tltrun generate {cfg.prompts}", "model": cfg.model}
    if not remaining:  # the killed run had written every response: nothing left to time
        step = _step_of_rows(cfg.step, [log.rows[r.id] for r in requests])
        meta["resumed"] = "every response came from an earlier, killed process: nothing timed"
        save_trace(Trace(meta=meta, steps=(step,)), out / "trace.json")
        print(f"{out}: all {len(requests)} responses were written before; wrote trace.json")
        return 0
    step = measured_step(
        cfg.step,
        result,
        policy_name=cfg.policy,
        hardware=hardware_name(engine_cfg.device),
        extra={"max_running_requests": engine_cfg.max_running_requests},
        policy_config=settings,
        policy_seed=engine_cfg.seed,
    )
    if done:
        meta["resumed"] = (
            f"{len(done)} of the {len(requests)} responses in generations.jsonl came from an "
            "earlier, killed process: this step holds and times the other ones"
        )
    save_trace(Trace(meta=meta, steps=(step,)), out / "trace.json")
    m = step.measured
    resumed = f" (and {len(done)} written before the resume)" if done else ""
    print(
        f"{len(result.outputs)} responses{resumed}, {m.total_tokens} tokens in {result.wall_s:.2f} s "
        f"({m.decode_tokens_per_s:.1f} decode tokens/s{_accept_text(m.mean_accept_len)}); "
        f"written to {out}"
    )
    return 0


def _step_of_rows(step: int, rows: list[dict[str, Any]]):
    """An unmeasured trace step of generations.jsonl rows (grouped by prompt id)."""
    from tltrun.rollout.measured_trace import prompt_of
    from tltsim.trace.schema import Prompt, Response, Step

    groups: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        groups.setdefault(prompt_of(row["id"]), []).append(row)
    prompts = tuple(
        Prompt(
            id=pid,
            prompt_tokens=len(group[0]["prompt_token_ids"]),
            responses=tuple(Response(len(r["output_token_ids"]), r["finish"]) for r in group),
        )
        for pid, group in groups.items()
    )
    return Step(step=step, prompts=prompts)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tltrun generate``."""
    gen = subparsers.add_parser(
        "generate", help="roll out prompts with the torch engine (optionally with SD)"
    )
    gen.add_argument(
        "--resume",
        action="store_true",
        help="continue the killed run in --out with its config.json: its finished responses "
        "are kept, the others generated",
    )
    add_dataclass_args(gen, GenerateConfig)
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)

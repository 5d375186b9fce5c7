"""veRL's rollout dumps -> a ``tlt-trace`` of your own run ("would TLT help MY run?").

    tltsim import-verl runs/rollout_data --tokenizer ~/models/Qwen2.5-7B-Instruct \\
        --max-response-tokens 8192 --out my_run.json
    tltsim replay my_run.json --model ~/models/Qwen2.5-7B-Instruct --num-gpus 64

veRL (and fastrl, the TLT paper's veRL fork) writes, with ``trainer.rollout_data_dir`` set, one
``STEP.jsonl`` per RL step (``RayPPOTrainer._dump_generations``; read in mit-han-lab/fastrl's
verl/trainer/ppo/ray_trainer.py at bce3df7): a row per response with the prompt and response as
text (``input``, ``output``: ``tokenizer.batch_decode(..., skip_special_tokens=True)``), its
``score`` and ``step``. No token counts,
so this importer counts tokens again with the model's own tokenizer (``tokenizer.json``, read by
Hugging Face ``tokenizers``; the only module of tltsim that needs it, imported here alone):

* response tokens: the text's tokens, plus one for the EOS that veRL's decode dropped
  (``skip_special_tokens=True``; veRL's ``response_length`` counts it); a response whose count
  comes within ``cut_slack`` (0.2%) of ``max_response_tokens`` (veRL's
  ``data.max_response_length``) was cut there: it is the cap, ``finish: "length"``; one 5% past
  it says the cap given is not the run's (an error: clamped, the tail was lost). Without the
  cap no response is known to be cut (a warning says so).
* prompt tokens: the decoded prompt's tokens. The chat template's special tokens were dropped by
  the decode too and are not counted (a few per message).
* Counts are of the text as encoded now, not of the tokens the model sampled: where it sampled a
  non-canonical split of a word, the two differ. Thinking tags the tokenizer marks special were
  dropped by the decode as well (a warning says so); a tokenizer.json saved with padding or
  truncation on is read with both off.
* groups: a step's rows with the same ``input`` (GRPO's n samples of a prompt; veRL's
  ``balance_batch`` reorders rows, so rows need not be adjacent), in order of first appearance.
  A prompt drawn k times in one step (k x n rows) becomes k groups of the step's most common
  group size n, when k x n rows it has. A group's id is a digest of its prompt text, the same in
  every step, so the simulated history drafter sees a prompt's earlier rollouts (epochs).

Bad input (a file that is not JSON lines, a row without ``input``/``output`` text, a ``step``
field other than its file's, two files of one step) is one error naming the file, line and
field. Lines end at ``\\n`` only (veRL writes ``ensure_ascii=False``: U+2028 and friends stand
unescaped inside a row).
"""

from __future__ import annotations

import hashlib
import json
import re
import warnings
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tltsim.errors import InputWarning
from tltsim.trace.errors import TraceError
from tltsim.trace.schema import MAX_COUNT, Prompt, Response, Step, Trace

STEP_FILE = re.compile(r"(\d+)\.jsonl")  # veRL's f"{global_steps}.jsonl"
VERL_SOURCE = "veRL rollout dumps (trainer.rollout_data_dir; RayPPOTrainer._dump_generations)"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, kw_only=True)
class VerlImportConfig:
    """How veRL's dumps become a trace (``tltsim import-verl``; one flag per field)."""

    tokenizer: str = field(
        metadata=_help("the model's tokenizer.json, or the model directory holding it")
    )
    max_response_tokens: int | None = field(
        default=None,
        metadata=_help(
            "the run's response cap (veRL's data.max_response_length): responses that reach it "
            "were cut (default: none known)"
        ),
    )
    max_steps: int | None = field(default=None, metadata=_help("use only the first N steps"))
    model: str | None = field(
        default=None, metadata=_help("model name for the trace's meta (default: the tokenizer's)")
    )

    def __post_init__(self) -> None:
        for name in ("max_response_tokens", "max_steps"):
            value = getattr(self, name)
            if value is not None and (type(value) is not int or not 1 <= value <= MAX_COUNT):
                raise ValueError(f"{name} must be an integer in [1, {MAX_COUNT}], got {value!r}")


def load_tokenizer(path: str) -> Any:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` (or a directory holding it)."""
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ValueError(
            "tokens are counted with Hugging Face tokenizers, which is not installed: "
            "pip install -e '.[import-verl]' (or the run extra)"
        ) from None
    file = Path(path)
    if file.is_dir():
        file = file / "tokenizer.json"
    if not file.is_file():
        raise ValueError(f"--tokenizer {path}: no tokenizer.json there")
    try:
        tok = Tokenizer.from_file(str(file))
    except Exception as err:  # tokenizers raises its own Exception types on a bad file
        raise ValueError(f"{file}: not a Hugging Face tokenizer.json ({err})") from None
    # a file saved with padding or truncation on (some released ones are) padded every text of
    # a batch to its longest, or cut long ones, without a word: counts are of the text alone
    tok.no_padding()
    tok.no_truncation()
    _warn_special_thinking_tags(tok, file)
    return tok


def _warn_special_thinking_tags(tok: Any, file: Path) -> None:
    """veRL's decode (``skip_special_tokens=True``) dropped the tokens the tokenizer marks
    special: thinking tags so marked are missing from every thinking response's text, and its
    count (Qwen3's are not special; some reasoning tokenizers' are)."""
    tags = sorted(
        t.content
        for t in tok.get_added_tokens_decoder().values()
        if t.special and "think" in t.content.lower()
    )
    if tags:
        warnings.warn(
            f"{file}: marks {', '.join(tags)} special: veRL's dump dropped them from the text "
            f"(skip_special_tokens), so a response that thinks counts {len(tags)} token(s) short",
            InputWarning,
            stacklevel=3,
        )


def step_files(directory: Path) -> list[tuple[int, Path]]:
    """veRL's ``STEP.jsonl`` files of ``directory``, by step; any other ``*.jsonl`` is refused
    (a file this importer would leave out, silently)."""
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (veRL's trainer.rollout_data_dir)")
    found, foreign = [], []
    for path in directory.glob("*.jsonl"):
        m = STEP_FILE.fullmatch(path.name)
        (found if m else foreign).append((int(m[1]) if m else -1, path))
    if foreign:
        names = ", ".join(sorted(p.name for _, p in foreign)[:3])
        raise ValueError(
            f"{directory}: {names}{' ...' if len(foreign) > 3 else ''}: not a veRL dump name "
            "(STEP.jsonl); move other files out of the directory"
        )
    if not found:
        raise ValueError(f"{directory}: no STEP.jsonl files (veRL's rollout dumps)")
    found.sort()
    if found[-1][0] > MAX_COUNT:  # (a trace's step numbers are int32: the file was refused later)
        raise ValueError(f"{found[-1][1]}: step {found[-1][0]} is past {MAX_COUNT}")
    for (step, a), (other, b) in zip(found, found[1:], strict=False):
        if step == other:
            raise ValueError(f"{directory}: {a.name} and {b.name} are both step {step}")
    return found


def read_rows(path: Path, step: int, is_last: bool = False) -> list[tuple[str, str, int]]:
    """(input, output, line number) of each row of one step's dump. The last step's file may
    be one a killed run left half written: an error that a cut write explains (its last line
    torn, its last character cut, no rows) says how to leave it out; others (a row naming
    another step, a field missing) are the file's own."""
    cut = (
        " (the run's last step: if it was killed while writing it, --max-steps leaves it out)"
        if is_last
        else ""
    )
    try:
        # "\n" only: veRL writes ensure_ascii=False, so U+2028, U+2029 and U+0085 (which
        # str.splitlines splits at) stand unescaped inside a row's text
        data = path.read_bytes()
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError as err:
        at_end = cut if err.start >= len(data) - 4 else ""  # a character cut in its bytes
        raise TraceError(
            f"{path}: not UTF-8 text ({err.reason} at byte {err.start}){at_end}"
        ) from None
    last_line = max((i for i, line in enumerate(lines, 1) if line.strip()), default=0)
    rows = []
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            torn = cut if line_no == last_line else ""
            raise TraceError(f"{path}:{line_no}: not a JSON line ({err.msg}){torn}") from None
        if not isinstance(row, dict):
            raise TraceError(f"{path}:{line_no}: expected a JSON object (a veRL dump row)")
        for key in ("input", "output"):
            if not isinstance(row.get(key), str):
                got = "missing" if key not in row else type(row[key]).__name__
                raise TraceError(f"{path}:{line_no}: field {key!r}: expected text, got {got}")
        if "step" in row and row["step"] != step:
            raise TraceError(
                f"{path}:{line_no}: field 'step': {row['step']!r}, but the file is step {step}"
            )
        rows.append((row["input"], row["output"], line_no))
    if not rows:
        raise TraceError(f"{path}: no rows{cut}")
    return rows


def groups_of(rows: list[tuple[str, str, int]]) -> list[tuple[str, list[int]]]:
    """(input, row indices) per GRPO group, in order of first appearance; a prompt with k times
    the most common group size of rows (of equally common sizes, the smallest) split into k
    groups."""
    by_input: dict[str, list[int]] = {}
    for i, (text, *_) in enumerate(rows):
        by_input.setdefault(text, []).append(i)
    # the most common size; a tie the smallest (the row order decided it: two prompts drawn
    # twice beside two drawn once made 16-row groups of a run of 8)
    sizes = Counter(len(ix) for ix in by_input.values())
    size = min(n for n, k in sizes.items() if k == max(sizes.values()))
    groups = []
    for text, ix in by_input.items():
        if len(ix) > size and len(ix) % size == 0:
            groups += [(text, ix[k : k + size]) for k in range(0, len(ix), size)]
        else:
            groups.append((text, ix))
    return groups


def prompt_ids(groups: list[tuple[str, list[int]]]) -> list[str]:
    """A group's trace id: a digest of its prompt text, the same in every step (the simulated
    history drafter indexes a prompt's earlier rollouts by it); a prompt's second group in one
    step gets ``#1``, as ``tltrun train`` names them."""
    seen: Counter[str] = Counter()
    ids = []
    for text, _ in groups:
        digest = "p" + hashlib.sha1(text.encode("utf-8")).hexdigest()[:12]
        ids.append(digest if not seen[digest] else f"{digest}#{seen[digest]}")
        seen[digest] += 1
    return ids


# texts encoded at once: encode_batch runs over all cores, and its Encoding objects (ids,
# offsets, masks) took 1.2 GB for a 23 MB dump encoded whole
ENCODE_CHUNK = 64


def token_counts(tok: Any, texts: list[str]) -> list[int]:
    """Tokens of each text, special tokens not added (the dump's text has none)."""
    counts = []
    for i in range(0, len(texts), ENCODE_CHUNK):
        batch = tok.encode_batch(texts[i : i + ENCODE_CHUNK], add_special_tokens=False)
        counts += [len(e.ids) for e in batch]
    return counts


def cut_slack(cap: int) -> int:
    """Tokens below the cap at which a recount still reads as cut there: the model may have
    sampled non-canonical splits, which the recount merges (0.2% of the cap, at least 2)."""
    return max(2, cap // 500)


def response(count: int, cap: int | None, where: str) -> Response:
    """A response whose text recounts to ``count`` tokens, in a run capped at ``cap``."""
    if cap is None:
        return Response(tokens=min(count + 1, MAX_COUNT))  # + the EOS the decode dropped
    if count > cap + max(8, cap // 20):  # 5% past it: not splits, a smaller cap than the run's
        raise TraceError(
            f"{where}: the output recounts to {count} tokens, past --max-response-tokens {cap}: "
            "give the run's cap (veRL's data.max_response_length)"
        )
    if count >= cap - cut_slack(cap):
        return Response(tokens=cap, finish="length")
    return Response(tokens=count + 1)


def import_step(
    step: int, path: Path, rows: list[tuple[str, str, int]], tok: Any, cap: int | None
) -> Step:
    out_counts = token_counts(tok, [o for _, o, _ in rows])
    groups = groups_of(rows)
    unique_inputs = list(dict.fromkeys(text for text, _ in groups))
    in_counts = dict(zip(unique_inputs, token_counts(tok, unique_inputs), strict=True))
    prompts = []
    for pid, (text, ix) in zip(prompt_ids(groups), groups, strict=True):
        responses = tuple(response(out_counts[i], cap, f"{path}:{rows[i][2]}") for i in ix)
        prompt_tokens = min(max(in_counts[text], 1), MAX_COUNT)
        prompts.append(Prompt(id=pid, prompt_tokens=prompt_tokens, responses=responses))
    return Step(step=step, prompts=tuple(prompts))


def import_verl(directory: str | Path, cfg: VerlImportConfig, progress: bool = True) -> Trace:
    """The trace of veRL's dumps in ``directory`` (module docstring)."""
    directory = Path(directory)
    tok = load_tokenizer(cfg.tokenizer)
    every = step_files(directory)
    files = every[: cfg.max_steps]
    if cfg.max_response_tokens is None:
        warnings.warn(
            "no --max-response-tokens: responses cut at the run's cap read as stopped there, "
            "with one token (an EOS) too many; give veRL's data.max_response_length",
            InputWarning,
            stacklevel=2,
        )
    steps = []
    bars = None if progress else True  # None: a bar on a terminal only (tqdm)
    for step, path in tqdm(files, desc="import-verl", unit="step", disable=bars):
        rows = read_rows(path, step, is_last=path == every[-1][1])
        steps.append(import_step(step, path, rows, tok, cfg.max_response_tokens))
    if cfg.max_response_tokens is not None:
        _warn_cap_not_reached(steps, cfg.max_response_tokens)
    sizes = {len(p.responses) for s in steps for p in s.prompts}
    tokenizer = Path(cfg.tokenizer).resolve()
    name = cfg.model or (tokenizer.name if tokenizer.is_dir() else tokenizer.parent.name)
    meta: dict[str, Any] = {
        "source": f"{VERL_SOURCE}: {directory.name}; tokens counted again with {name}'s "
        "tokenizer (tltsim.trace.verl)",
        "model": name,
        "importer": {"kind": "verl", "dir": str(directory), **asdict(cfg)},
    }
    if cfg.max_response_tokens is not None:
        meta["max_response_tokens"] = cfg.max_response_tokens
    if len(sizes) == 1:
        meta["group_size"] = sizes.pop()
    return Trace(meta=meta, steps=tuple(steps))


def _warn_cap_not_reached(steps: list[Step], cap: int) -> None:
    """A cap above the run's read its cut responses as stopped a token past it: where none
    reaches the cap but a cluster of the longest recounts to one length (at least 5 and 1% of
    the responses, less than half, within ``cut_slack`` of it: a natural tail thins out
    instead), say so."""
    lengths = [r.tokens for s in steps for p in s.prompts for r in p.responses]
    if any(r.finish == "length" for s in steps for p in s.prompts for r in p.responses):
        return
    longest = max(lengths)
    near = sum(n >= longest - cut_slack(longest) for n in lengths)
    # (most responses of one length are no tail: a run whose answers are all alike)
    if max(5, len(lengths) / 100) <= near < len(lengths) / 2 and longest < cap - cut_slack(cap):
        warnings.warn(
            f"no response reaches --max-response-tokens {cap}, but {near} of {len(lengths)} end "
            f"within {cut_slack(longest)} tokens of the longest ({longest - 1} tokens and an EOS):"
            f" was the run's cap {longest - 1}? (they read as stopped, not cut)",
            InputWarning,
            stacklevel=3,
        )


__all__ = ["VerlImportConfig", "import_verl"]

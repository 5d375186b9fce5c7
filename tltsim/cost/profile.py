"""Measured cost profiles: the CSV schema ``tltrun profile`` writes, its grid, and load/write.

``tltsim.cost.measured.ProfileCost`` interpolates a loaded profile as a cost model (issue #7);
``tltsim replay --profile FILE`` uses it instead of the roofline, and ``tltsim profile-info
FILE`` prints the grid and how far the roofline is from it.

    from tltsim.cost.profile import ProfileGrid, grid_points, load_profile, write_profile
    points = grid_points(ProfileGrid())      # (op, batch, context_tokens, tokens_per_seq) to time
    profile = load_profile("profiles/cpu_torch.csv")

Schema: ``tlt-profile`` version 1
---------------------------------
A CSV file with this header and one row per measured point (any row order)::

    op,batch,context_tokens,tokens_per_seq,seconds,seconds_p10,seconds_p90,num_repeats

* ``seconds`` is the median over ``num_repeats`` timed repeats (after warm-up), ``seconds_p10``
  and ``seconds_p90`` their 10th / 90th percentiles: 0 < p10 <= seconds <= p90.
* ``batch`` >= 1 and ``tokens_per_seq`` >= 1 are integers; ``context_tokens`` >= 0 is the integer
  number of KV tokens attended over the whole batch (already cached before the forward).
* ``op`` is one of (in brackets: the axes ``ProfileCost`` interpolates it over, outermost first):

  ``decode``        one target forward, ``tokens_per_seq`` = 1 [batch, context per sequence]
  ``verify``        one target forward over verify tokens + 1 (the root) per sequence,
                    ``tokens_per_seq`` >= 2 [tokens_per_seq, batch, context per sequence]
  ``drafter``       one drafter forward (one draft step); ``tokens_per_seq`` = frontier tokens
                    per sequence (topk) [tokens_per_seq, batch, context per sequence]
  ``prefill``       target prefill of ``batch`` prompts of ``tokens_per_seq`` tokens each,
                    ``context_tokens`` = 0 [batch, tokens per sequence]
  ``sd_switch``     turning SD on for ``batch`` running sequences of ``context_tokens / batch``
                    tokens each, as the profiled engine does it; ``tokens_per_seq`` = that,
                    rounded [batch, context per sequence]. The roofline charges TLT's
                    re-prefill of target and drafter; tltrun's torch engine keeps the target's
                    hidden states and re-prefills the drafter only (``tltrun.profile.measure``),
                    so ``profile-info``'s measured/roofline ratio for it is well below 1
  ``train``         one actor update (forward + backward + optimizer step) over ``batch``
                    sequences of ``tokens_per_seq`` tokens; ``context_tokens`` = 0
                    [sequence tokens, sequences per update]; a step with more sequences
                    costs that many updates of the largest measured size
  ``drafter_train`` one drafter update, likewise

  Each innermost curve (e.g. decode at one batch size, train at one sequence length) needs >= 2
  distinct points. ``decode``, ``verify``, ``drafter``, ``prefill``, ``train`` and
  ``drafter_train`` are required unless ``ProfileCost`` gets a fallback cost model; ``sd_switch``
  is optional (without it the switch costs the target's re-prefill alone; the drafter's one
  layer would add about 1/num_layers to that).
* Sidecar ``<profile stem>.json`` next to the CSV: ``{"format": "tlt-profile", "version": 1,
  "hardware": str, "backend": "torch"|"vllm", "tp": int, "model": {HF config.json} or a preset
  name, "software": {"python": .., "torch": .., "vllm": ..}, "date": ISO 8601}``; more keys
  are allowed and kept. ``tltrun profile`` also writes ``"statistic"`` (``"median"`` or
  ``"mean"``: which statistic of the repeats the ``seconds`` column holds) and ``"clock"``
  (``"wall"`` or ``"cpu"``: what a second is); ``tltsim compare`` refuses a measured trace timed
  with another clock than its profile (absent: ``"wall"``), and ``"attention_context"``:
  ``"summed"`` (paged attention reads each sequence's own context: vLLM) or ``"padded"`` (dense
  batched attention reads the longest sequence's context for every sequence, and prefill pads
  prompts to the longest: older engines, and tltrun's torch engine with dense attention; with
  flex attention, its CUDA default, it reads each sequence's own: summed); absent:
  ``"summed"``. ``ProfileCost`` of a padded profile has ``is_context_padded``, and the simulator then costs an iteration at
  batch x the longest context (its rows were measured with equal contexts, where both agree).

Bad input raises ``ProfileError`` (a ``UsageError``: ``tltsim`` prints one line, exits 2) naming
the file, the row (1 = header), the column and what was expected.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tltsim.errors import UsageError

FORMAT = "tlt-profile"
VERSION = 1
COLUMNS = (
    "op",
    "batch",
    "context_tokens",
    "tokens_per_seq",
    "seconds",
    "seconds_p10",
    "seconds_p90",
    "num_repeats",
)
OPS = ("decode", "verify", "drafter", "prefill", "sd_switch", "train", "drafter_train")
REQUIRED_OPS = ("decode", "verify", "drafter", "prefill", "train", "drafter_train")
META_KEYS = ("hardware", "backend", "tp", "model", "software", "date")
# Largest integer cell (batch, context, tokens, repeats): int32, as the trace format's bound.
MAX_INT = 2**31 - 1
ATTENTION_CONTEXTS = ("summed", "padded")  # optional sidecar key attention_context (docstring)


class ProfileError(UsageError):
    """Bad profile input: one line naming the file, the row, the column and what was expected."""


@dataclass(frozen=True)
class ProfileRow:
    op: str
    batch: int
    context_tokens: int
    tokens_per_seq: int
    seconds: float
    seconds_p10: float
    seconds_p90: float
    num_repeats: int

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.op, self.batch, self.context_tokens, self.tokens_per_seq)


@dataclass(frozen=True)
class Profile:
    rows: tuple[ProfileRow, ...]
    meta: dict[str, Any] = field(default_factory=dict)
    source: str = "<profile>"

    def rows_of(self, op: str) -> list[ProfileRow]:
        return [r for r in self.rows if r.op == op]

    @property
    def ops(self) -> tuple[str, ...]:
        present = {r.op for r in self.rows}
        return tuple(op for op in OPS if op in present)


def sidecar_path(path: str | Path) -> Path:
    return Path(path).with_suffix(".json")


# --- the grid a profiler measures ------------------------------------------------------------


@dataclass(frozen=True)
class ProfileGrid:
    """Axes of a profile measurement. Defaults cover a GPU rollout (a CPU profiler passes
    smaller ones); points beyond them are extrapolated linearly, with a warning.

    Doubling steps on every axis: within a roofline regime the interpolation is exact, and a
    regime change (memory- to compute-bound) is reconstructed when it has a full grid segment
    on either side (``tltsim.cost.interp``), so the grid should reach one step past the sizes that
    matter. Batches up to veRL's max_num_seqs default (1024), contexts from short prompts (32
    tokens) to 32k; verify tokens + 1 of chains of 1, 2, 4, 8 draft steps and of fastrl's TLT
    trees 8_4_{8,16,32,48} (9, 17, 33, 49)."""

    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
    context_per_seq: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
    verify_tokens_per_seq: tuple[int, ...] = (2, 3, 5, 9, 17, 33, 49)
    drafter_tokens_per_seq: tuple[int, ...] = (1, 2, 4, 8)
    prefill_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64)
    prefill_tokens_per_seq: tuple[int, ...] = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
    train_batches: tuple[int, ...] = (1, 2, 4, 8)
    train_tokens_per_seq: tuple[int, ...] = (512, 2048, 8192)
    # Points whose batch context exceeds this are skipped: they would not fit the KV cache.
    # 2^20 tokens x 57,344 KV bytes per token (Qwen2.5-7B: 2 x 28 layers x 512 x 2 B) = 60 GB,
    # which fits next to the 15 GB of weights on an 80 GB GPU.
    max_context_tokens: int = 1 << 20

    def __post_init__(self) -> None:
        for name in self.__dataclass_fields__:
            values = getattr(self, name)
            if name == "max_context_tokens":
                continue
            if not values or any(type(v) is not int or v < 1 for v in values):
                raise ValueError(
                    f"ProfileGrid: {name} must be non-empty positive integers, got {values!r}"
                )
            if list(values) != sorted(set(values)):
                raise ValueError(f"ProfileGrid: {name} must be strictly increasing, got {values!r}")
        if 1 in self.verify_tokens_per_seq:
            raise ValueError(
                "ProfileGrid: verify_tokens_per_seq must be >= 2 (decode is tokens_per_seq 1)"
            )
        for name in ("prefill_tokens_per_seq", "train_batches"):
            if len(getattr(self, name)) < 2:
                raise ValueError(f"ProfileGrid: {name} needs >= 2 values to interpolate")
        for batch in self.batches + self.prefill_batches:
            if len(self.contexts(batch)) < 2:
                raise ValueError(
                    f"ProfileGrid: batch {batch} has < 2 context_per_seq values within max_context_tokens={self.max_context_tokens}"
                )

    def contexts(self, batch: int) -> list[int]:
        """Batch context tokens measured at ``batch``: those within ``max_context_tokens``."""
        return [batch * c for c in self.context_per_seq if batch * c <= self.max_context_tokens]


def grid_points(grid: ProfileGrid) -> list[tuple[str, int, int, int]]:
    """Every ``(op, batch, context_tokens, tokens_per_seq)`` a profiler should time."""
    points = []
    for batch in grid.batches:
        for context in grid.contexts(batch):
            points.append(("decode", batch, context, 1))
            points.extend(("verify", batch, context, t) for t in grid.verify_tokens_per_seq)
            points.extend(("drafter", batch, context, t) for t in grid.drafter_tokens_per_seq)
    for batch in grid.prefill_batches:
        points.extend(("prefill", batch, 0, t) for t in grid.prefill_tokens_per_seq)
        points.extend(("sd_switch", batch, c, c // batch) for c in grid.contexts(batch))
    for op in ("train", "drafter_train"):
        for seq in grid.train_tokens_per_seq:
            points.extend((op, batch, 0, seq) for batch in grid.train_batches)
    return points


# --- reading and writing ---------------------------------------------------------------------


def write_profile(rows: Iterable[ProfileRow], path: str | Path, meta: Mapping[str, Any]) -> None:
    """Write ``path`` (CSV) and its sidecar JSON; ``meta`` needs the keys of ``META_KEYS``."""
    path = Path(path)
    if path.suffix.lower() != ".csv":
        raise ProfileError(f"{path}: a profile file name must end in .csv")
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ProfileError(f"{path}: profile meta is missing {', '.join(missing)}")
    rows = list(rows)
    for i, row in enumerate(rows, start=2):
        _check_row(row, str(path), i)
    _check_duplicates(rows, str(path), list(range(2, len(rows) + 2)))
    path.parent.mkdir(parents=True, exist_ok=True)
    # Both files go to temporary names first and replace the old ones whole: `tltrun profile`
    # rewrites its profile after every round, and a kill mid-write must not leave a torn CSV.
    csv_tmp = path.with_name(f".{path.name}.tmp")
    side_tmp = path.with_name(f".{sidecar_path(path).name}.tmp")
    with csv_tmp.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(COLUMNS)
        for r in rows:
            writer.writerow(
                [
                    r.op,
                    r.batch,
                    r.context_tokens,
                    r.tokens_per_seq,
                    repr(r.seconds),
                    repr(r.seconds_p10),
                    repr(r.seconds_p90),
                    r.num_repeats,
                ]
            )
    side = {"format": FORMAT, "version": VERSION, **dict(meta)}
    side_tmp.write_text(json.dumps(side, indent=2, sort_keys=True) + "\n")
    os.replace(side_tmp, sidecar_path(path))
    os.replace(csv_tmp, path)


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile CSV and its sidecar; any problem raises one-line ProfileError."""
    path = Path(path)
    source = str(path)
    try:
        text = path.read_text(encoding="utf-8-sig")  # -sig: a spreadsheet's leading BOM is not data
    except OSError as err:
        raise ProfileError(f"{source}: cannot read the profile ({err.strerror or err})") from None
    except UnicodeDecodeError as err:
        raise ProfileError(
            f"{source}: not a text CSV profile (byte {err.start} is not UTF-8; binary or corrupted?)"
        ) from None
    lines = text.splitlines()
    if not lines or not lines[0].strip():
        raise ProfileError(f"{source}: empty file (expected the header {','.join(COLUMNS)})")
    reader = csv.reader(lines)
    header = [h.strip() for h in next(reader)]
    missing = [c for c in COLUMNS if c not in header]
    if missing:
        raise ProfileError(
            f"{source}: row 1 (header): missing column '{missing[0]}' (expected {','.join(COLUMNS)})"
        )
    extra = [c for c in header if c not in COLUMNS]
    if extra:
        raise ProfileError(
            f"{source}: row 1 (header): unknown column '{extra[0]}' (expected only {','.join(COLUMNS)})"
        )
    repeated = [c for i, c in enumerate(header) if c in header[:i]]
    if repeated:  # else the first is read and the other silently ignored
        raise ProfileError(f"{source}: row 1 (header): column '{repeated[0]}' appears twice")
    col = {name: header.index(name) for name in COLUMNS}
    rows, line_nos = [], []
    for line_no, cells in enumerate(reader, start=2):
        if not cells or all(not c.strip() for c in cells):
            continue  # a blank line carries no point
        if len(cells) != len(header):
            raise ProfileError(
                f"{source}: row {line_no}: expected {len(header)} cells, got {len(cells)}"
            )
        row = _parse_row({name: cells[i].strip() for name, i in col.items()}, source, line_no)
        _check_row(row, source, line_no)
        rows.append(row)
        line_nos.append(line_no)
    if not rows:
        raise ProfileError(
            f"{source}: no measured rows after the header (expected one row per measured point)"
        )
    _check_duplicates(rows, source, line_nos)
    return Profile(rows=tuple(rows), meta=_load_meta(path), source=source)


def _parse_row(cells: dict[str, str], source: str, line_no: int) -> ProfileRow:
    def bad(column: str, expected: str) -> ProfileError:
        return ProfileError(
            f"{source}: row {line_no}: column '{column}': expected {expected}, got {cells[column]!r}"
        )

    def is_plain(text: str) -> bool:
        # int() and float() also take "1_0" (= 10) and non-ASCII digits: a typo read as a
        # different point, never an error
        return text.isascii() and "_" not in text

    def integer(column: str) -> int:
        try:
            if not is_plain(cells[column]):
                raise ValueError
            value = int(cells[column])
        except ValueError:
            raise bad(column, "an integer") from None
        if abs(value) > MAX_INT:  # a corrupted cell, not a batch or context length
            raise bad(column, f"an integer <= {MAX_INT}")
        return value

    def number(column: str) -> float:
        try:
            if not is_plain(cells[column]):
                raise ValueError
            value = float(cells[column])
        except ValueError:
            raise bad(column, "a number") from None
        if not math.isfinite(value):
            raise bad(column, "a finite number")
        return value

    if cells["op"] not in OPS:
        raise bad("op", "one of " + ", ".join(OPS))
    return ProfileRow(
        cells["op"],
        integer("batch"),
        integer("context_tokens"),
        integer("tokens_per_seq"),
        number("seconds"),
        number("seconds_p10"),
        number("seconds_p90"),
        integer("num_repeats"),
    )


def _check_row(r: ProfileRow, source: str, line_no: int) -> None:
    def fail(column: str, expected: str) -> None:
        raise ProfileError(
            f"{source}: row {line_no}: column '{column}': expected {expected}, got {getattr(r, column)!r}"
        )

    if r.op not in OPS:
        fail("op", "one of " + ", ".join(OPS))
    if r.batch < 1:
        fail("batch", "an integer >= 1")
    if r.tokens_per_seq < 1:
        fail("tokens_per_seq", "an integer >= 1")
    if r.context_tokens < 0:
        fail("context_tokens", "an integer >= 0")
    if not r.seconds > 0:
        fail("seconds", "a number > 0")
    if not 0 < r.seconds_p10 <= r.seconds:
        fail("seconds_p10", f"a number in (0, seconds={r.seconds!r}]")
    if not r.seconds_p90 >= r.seconds:
        fail("seconds_p90", f"a number >= seconds={r.seconds!r}")
    if r.num_repeats < 1:
        fail("num_repeats", "an integer >= 1")
    if r.op == "decode" and r.tokens_per_seq != 1:
        fail("tokens_per_seq", "1 for op decode (use op verify for more tokens per sequence)")
    if r.op == "verify" and r.tokens_per_seq < 2:
        fail("tokens_per_seq", "an integer >= 2 for op verify (verify tokens + the root)")
    if r.op in ("prefill", "train", "drafter_train") and r.context_tokens != 0:
        fail("context_tokens", f"0 for op {r.op} (measured without cached context)")
    if r.op == "sd_switch" and r.context_tokens < r.batch:
        fail(
            "context_tokens",
            f"an integer >= batch={r.batch} for op sd_switch (tokens re-prefilled)",
        )
    if r.op == "sd_switch" and abs(r.tokens_per_seq - r.context_tokens / r.batch) >= 1:
        fail(
            "tokens_per_seq",
            f"context_tokens / batch = {r.context_tokens / r.batch:g}, rounded, for op sd_switch",
        )


def _check_duplicates(rows: list[ProfileRow], source: str, line_nos: list[int]) -> None:
    """Each point once; an error names both rows by their line in the file (blank lines,
    skipped, count)."""
    seen: dict[tuple, int] = {}
    for i, r in zip(line_nos, rows, strict=True):
        # sd_switch's table is keyed by batch and context (its tokens_per_seq only restates
        # context / batch, rounded either way): two rows there would silently be one
        key = r.key[:3] if r.op == "sd_switch" else r.key
        if key in seen:
            raise ProfileError(
                f"{source}: row {i}: duplicate point op={r.op} batch={r.batch} context_tokens={r.context_tokens} tokens_per_seq={r.tokens_per_seq} (first at row {seen[key]})"
            )
        seen[key] = i


def _load_meta(path: Path) -> dict[str, Any]:
    side = sidecar_path(path)
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ProfileError(
            f"{side}: missing sidecar of {path.name} (expected hardware/software JSON written by tltrun profile)"
        ) from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ProfileError(f"{side}: cannot read the sidecar JSON ({err})") from None
    except RecursionError:
        raise ProfileError(f"{side}: sidecar JSON nested too deeply to parse") from None
    if type(meta) is not dict:
        raise ProfileError(f"{side}: expected a JSON object, got {type(meta).__name__}")
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ProfileError(
            f"{side}: field 'format'/'version': expected '{FORMAT}' version {VERSION}, got {meta.get('format')!r} {meta.get('version')!r}"
        )
    missing = [k for k in META_KEYS if k not in meta]
    if missing:
        raise ProfileError(
            f"{side}: missing field '{missing[0]}' (expected {', '.join(META_KEYS)})"
        )
    if type(meta["tp"]) is not int or meta["tp"] < 1:
        raise ProfileError(f"{side}: field 'tp': expected an integer >= 1, got {meta['tp']!r}")
    if meta.get("attention_context", "summed") not in ATTENTION_CONTEXTS:
        raise ProfileError(
            f"{side}: field 'attention_context': expected one of {', '.join(ATTENTION_CONTEXTS)}, got {meta['attention_context']!r}"
        )
    return meta


__all__ = [
    "ATTENTION_CONTEXTS",
    "COLUMNS",
    "FORMAT",
    "META_KEYS",
    "OPS",
    "Profile",
    "ProfileError",
    "ProfileGrid",
    "ProfileRow",
    "REQUIRED_OPS",
    "grid_points",
    "load_profile",
    "sidecar_path",
    "write_profile",
]

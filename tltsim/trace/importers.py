"""Importers: public request-length data -> ``tlt-trace`` RL steps of ``prompts x group_size``.

    tltsim import servegen   /work/shared/traces/servegen_deepseek_r1_output_tokens.csv.gz --out t.json
    tltsim import azure-conv /work/shared/traces/azure_llm_inference_2023_conv.csv --out t.json

Sources (see /work/shared/traces/README.md; keep the attribution with anything derived):

* ``servegen``: DeepSeek-R1 output tokens per request, from alibaba/ServeGen
  ``data/reason/deepseek-r1`` (Apache-2.0). Columns ``client_id,window_start_s,output_tokens``;
  ``--client-id`` / ``--window-start-s`` pick one client and/or one 6-hour window (default: all).
* ``azure-code`` / ``azure-conv``: Azure LLM inference trace 2023 (Azure/AzurePublicDataset,
  CC-BY-4.0; Patel et al., "Splitwise", ISCA 2024). Columns ``TIMESTAMP,ContextTokens,GeneratedTokens``.

Serving data has request lengths but no RL groups, so groups are formed here (a rank copula):

1. Per step, draw ``prompts x group_size`` lengths i.i.d. from the selected source rows (with
   replacement) and sort them. The step's lengths are thus an exact bootstrap sample of the
   source: the marginal length distribution is the source's (tests/test_importers.py checks it).
2. Draw latent scores with the synthetic generator's group model (``tltsim.trace.synth.latent_scores``:
   a per-prompt difficulty plus per-sample scatter that widens for harder prompts).
3. Hand the k-th shortest drawn length to the response with the k-th lowest score.

Only the ranks of the scores matter, so the source keeps its own shape while a group's samples
sit close together in rank: correlated groups, as in RL. On the ServeGen data with 32 prompts x 8
the median prompt's group spans about 2.5x (longest / shortest) and the step's worst group
typically 8-23x (10th-90th percentile over steps); see the table in traces/README.md.

Prompt lengths: Azure has ``ContextTokens``; each prompt gets one drawn at random (independently
of its responses: the measured log-log correlation is -0.005 (code) and 0.09 (conv)). ServeGen
has no input lengths; prompts get the synthetic generator's lognormal prompt lengths (median and
spread from the Azure conversation trace, see ``tltsim.trace.synth.GenConfig``).

The response cap (``max_response_tokens``) defaults to the largest length in the file, whichever
rows are selected: 32,768 for ServeGen R1, where requests pile up at the service's output limit; responses equal
to the cap are marked ``finish: "length"``. The Azure files do not say which requests were cut.
"""

from __future__ import annotations

import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from tltsim.errors import InputWarning
from tltsim.trace.schema import MAX_COUNT, Trace, TraceError, trace_from_arrays
from tltsim.trace.synth import (
    DIFFICULTY_SIGMA,
    GROUP_SIGMA,
    GROUP_SIGMA_GROWTH,
    GenConfig,
    check_shape,
    latent_scores,
    lognormal_ints,
)
from tltsim.trace.table import csv_row_lines

SERVEGEN_COLUMNS = ("client_id", "window_start_s", "output_tokens")
AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
SERVEGEN_ATTRIBUTION = "alibaba/ServeGen data/reason/deepseek-r1 (Apache-2.0)"
AZURE_ATTRIBUTION = "Azure/AzurePublicDataset AzureLLMInferenceDataset2023 (CC-BY-4.0); Patel et al., Splitwise, ISCA 2024"
KINDS = ("servegen", "azure-code", "azure-conv")
_PROMPT_DEFAULTS = GenConfig()


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class ImportConfig:
    """How request lengths become RL steps (one CLI flag per field: ``--num-steps`` ...)."""

    num_steps: int = field(default=8, metadata=_help("RL steps to build"))
    prompts_per_step: int = field(default=32, metadata=_help("prompts per step"))
    group_size: int = field(default=8, metadata=_help("responses (samples) per prompt"))
    max_response_tokens: int | None = field(
        default=None,
        metadata=_help(
            "response cap; longer source lengths are cut to it (default: the source's maximum)"
        ),
    )
    difficulty_sigma: float = field(
        default=DIFFICULTY_SIGMA,
        metadata=_help("latent spread across prompts (see tltsim.trace.synth)"),
    )
    group_sigma: float = field(
        default=GROUP_SIGMA, metadata=_help("latent spread within a group at the median prompt")
    )
    group_sigma_growth: float = field(
        default=GROUP_SIGMA_GROWTH,
        metadata=_help("growth of the within-group spread with difficulty"),
    )
    median_prompt_tokens: float = field(
        default=_PROMPT_DEFAULTS.median_prompt_tokens,
        metadata=_help("servegen only: median prompt length"),
    )
    prompt_tokens_sigma: float = field(
        default=_PROMPT_DEFAULTS.prompt_tokens_sigma,
        metadata=_help("servegen only: log std. dev. of prompt length"),
    )
    client_id: int | None = field(
        default=None, metadata=_help("servegen only: use this client's rows (default: all)")
    )
    window_start_s: int | None = field(
        default=None, metadata=_help("servegen only: use this 6-hour window's rows (default: all)")
    )
    seed: int = field(default=0, metadata=_help("random seed (same seed, same trace)"))

    def __post_init__(self) -> None:
        check_shape(self, ("num_steps", "prompts_per_step", "group_size"))  # as tltsim gen's
        if self.max_response_tokens is not None and (
            type(self.max_response_tokens) is not int
            or not 1 <= self.max_response_tokens <= MAX_COUNT
        ):
            raise ValueError(
                f"max_response_tokens must be an integer in [1, {MAX_COUNT}], got "
                f"{self.max_response_tokens!r}"
            )
        if type(self.seed) is not int or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed must be an integer in [0, 2^63 - 1], got {self.seed!r}")
        # not (nan < 10) and not (inf < 10): both refused
        if not (0 < self.difficulty_sigma < 10 and 0 <= self.group_sigma < 10):
            raise ValueError("difficulty_sigma must be in (0, 10) and group_sigma in [0, 10)")
        if not abs(self.group_sigma_growth) < 10:
            raise ValueError("group_sigma_growth must be finite and in (-10, 10)")
        if not (1 <= self.median_prompt_tokens <= MAX_COUNT and 0 <= self.prompt_tokens_sigma < 10):
            raise ValueError(
                f"median_prompt_tokens must be in [1, {MAX_COUNT}] and prompt_tokens_sigma in [0, 10)"
            )


def _read_csv(path: Path, columns: tuple[str, ...]) -> pd.DataFrame:
    try:
        with warnings.catch_warnings():
            # index_col=False: rows ending in a comma (spreadsheet exports) are read as the header
            # says; pandas otherwise took their first column for the index and shifted every
            # column by one. A row with more values than the header is refused (pandas drops the
            # extra with a ParserWarning).
            warnings.simplefilter("error", pd.errors.ParserWarning)
            frame = pd.read_csv(path, index_col=False)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except pd.errors.EmptyDataError:
        raise TraceError(f"{path}: empty file: expected columns {','.join(columns)}") from None
    except pd.errors.ParserWarning:
        raise TraceError(
            f"{path}: rows with more values than the header has columns (expected columns "
            f"{','.join(columns)})"
        ) from None
    except (pd.errors.ParserError, UnicodeDecodeError, OSError, EOFError) as err:
        raise TraceError(
            f"{path}: not a readable CSV: {str(err).strip().splitlines()[0]}"
        ) from None
    missing = [c for c in columns if c not in frame.columns]
    if missing:
        raise TraceError(
            f"{path}: missing column '{missing[0]}' (expected columns {','.join(columns)})"
        )
    if frame.empty:
        raise TraceError(f"{path}: no rows: expected one row per request")
    return frame


def _text(value: Any) -> str:
    """A cell as the file wrote it, near enough for a message (numpy's repr says np.float64)."""
    if isinstance(value, float | np.floating) and float(value).is_integer():
        return str(int(value))
    return str(value) if isinstance(value, np.generic) else repr(value)


def _positive_ints(frame: pd.DataFrame, column: str, path: Path) -> np.ndarray:
    """``frame[column]`` (rows of the file, perhaps a selection of them) as positive integers;
    an error names the file's line (header line 1, rows from 2), or its row where the lines
    cannot be read again (a pipe)."""
    values = frame[column]
    rows = frame.index.to_numpy()  # read_csv's RangeIndex: a row's place among the file's rows

    def place(i: int) -> str:  # the file line of selected row i (blank lines skipped by pandas)
        try:
            lines = csv_row_lines(path, has_meta=False)
        except (OSError, ValueError, EOFError):  # a stream read once; a damaged gzip tail
            lines = []
        return f"line {lines[rows[i]]}" if rows[i] < len(lines) else f"row {rows[i] + 1}"

    if values.dtype.kind == "b":  # True is not a count of 1
        raise TraceError(
            f"{path}: {place(0)}: column '{column}': expected a positive integer, got "
            f"{values.iloc[0]}"
        )
    if values.dtype.kind not in "iu":
        # a float column: integral values are counts (a blank cell in a row not selected makes
        # the whole column float); anything else names its line
        numeric = pd.to_numeric(values, errors="coerce")
        bad = np.flatnonzero(numeric.isna().to_numpy() | (numeric % 1 != 0).to_numpy())
        if bad.size:
            i = int(bad[0])
            raise TraceError(
                f"{path}: {place(i)}: column '{column}': expected a positive integer, got "
                f"{_text(values.iloc[i])}"
            )
        # every selected value a whole number (text in a row not selected made the column
        # text: the first selected row was blamed for it)
        values = numeric.astype(np.float64)
    if values.dtype.kind == "u" and values.size and int(values.max()) > MAX_COUNT:
        values = values.astype(np.float64)  # beyond int64: compared (and named) as floats
    ints = values.to_numpy(dtype=np.int64) if values.dtype.kind in "iu" else values.to_numpy()
    # a trace's lengths are at most MAX_COUNT (its schema's bound; a larger one overflowed totals)
    bad = np.flatnonzero((ints < 1) | (ints > MAX_COUNT))
    if bad.size:
        i = int(bad[0])
        raise TraceError(
            f"{path}: {place(i)}: column '{column}': expected a positive integer up to "
            f"{MAX_COUNT}, got {_text(frame[column].iloc[i])}"
        )
    return ints.astype(np.int64)


def read_servegen(
    path: Path, client_id: int | None = None, window_start_s: int | None = None
) -> tuple[np.ndarray, int]:
    """``(output tokens of the selected rows, the file's largest)`` (int64, int): the service's
    output limit shows in the whole file's maximum, whichever rows are selected."""
    frame = _read_csv(path, SERVEGEN_COLUMNS)
    keep = np.ones(len(frame), dtype=bool)
    if client_id is not None:
        keep &= frame["client_id"].to_numpy() == client_id
    if window_start_s is not None:
        keep &= frame["window_start_s"].to_numpy() == window_start_s
    if not keep.any():
        raise TraceError(
            f"{path}: no rows with client_id={client_id}, window_start_s={window_start_s}"
        )
    pool = _positive_ints(frame.loc[keep], "output_tokens", path)
    # rows not selected are not checked: only a finite maximum of them counts
    everywhere = pd.to_numeric(frame["output_tokens"], errors="coerce")
    everywhere = everywhere[(everywhere >= 1) & (everywhere <= MAX_COUNT)].max()  # NaN if none
    file_max = int(everywhere) if np.isfinite(everywhere) else 0
    return pool, max(file_max, int(pool.max()))


def read_azure(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """``(context_tokens, generated_tokens)`` per request (int64)."""
    frame = _read_csv(path, AZURE_COLUMNS)
    return _positive_ints(frame, "ContextTokens", path), _positive_ints(
        frame, "GeneratedTokens", path
    )


def warn_small_pool(path: Path, pool: np.ndarray, cfg: ImportConfig) -> None:
    """An ``InputWarning`` when a step draws more responses than the selection has rows: the
    bootstrap then repeats rows within a step (one row makes every response the same length)."""
    num_per_step = cfg.prompts_per_step * cfg.group_size
    if pool.size < num_per_step:
        warnings.warn(
            f"{path}: {pool.size} selected rows ({np.unique(pool).size} distinct lengths) for "
            f"{num_per_step} responses a step: each step repeats rows of this small selection",
            InputWarning,
            stacklevel=2,
        )


def group_by_rank(rng: np.random.Generator, pool: np.ndarray, cfg: ImportConfig) -> np.ndarray:
    """Lengths (steps, prompts, group): per step a bootstrap sample of ``pool``, handed out in
    the rank order of the latent group scores (module docstring, steps 1-3)."""
    num_steps, num_per_step = cfg.num_steps, cfg.prompts_per_step * cfg.group_size
    scores = latent_scores(
        rng,
        (cfg.num_steps, cfg.prompts_per_step),
        cfg.group_size,
        cfg.difficulty_sigma,
        cfg.group_sigma,
        cfg.group_sigma_growth,
    )
    draws = np.sort(rng.choice(pool, size=(num_steps, num_per_step), replace=True), axis=1)
    order = np.argsort(scores.reshape(num_steps, num_per_step), axis=1, kind="stable")
    lengths = np.empty_like(draws)
    np.put_along_axis(lengths, order, draws, axis=1)  # k-th lowest score gets k-th shortest length
    return lengths.reshape(scores.shape)


def _meta(
    kind: str, path: Path, cfg: ImportConfig, cap: int, model: str, attribution: str
) -> dict[str, Any]:
    return {
        "source": f"{attribution}; file {path.name}; groups formed by tltsim.importers (rank copula)",
        "model": model,
        "max_response_tokens": cap,
        "group_size": cfg.group_size,
        "importer": {"kind": kind, "file": path.name, **asdict(cfg)},
    }


def import_servegen(path: str | Path, cfg: ImportConfig) -> Trace:
    path = Path(path)
    pool, source_max = read_servegen(path, cfg.client_id, cfg.window_start_s)
    cap = cfg.max_response_tokens or source_max
    warn_small_pool(path, pool, cfg)
    rng = np.random.default_rng(cfg.seed)
    lengths = group_by_rank(rng, np.minimum(pool, cap), cfg)
    prompt_tokens = lognormal_ints(
        rng,
        (cfg.num_steps, cfg.prompts_per_step),
        cfg.median_prompt_tokens,
        cfg.prompt_tokens_sigma,
        2**31 - 1,
    )
    return trace_from_arrays(
        lengths,
        prompt_tokens,
        _meta("servegen", path, cfg, cap, "DeepSeek-R1", SERVEGEN_ATTRIBUTION),
    )


def import_azure(path: str | Path, cfg: ImportConfig, kind: str = "azure-conv") -> Trace:
    path = Path(path)
    if cfg.client_id is not None or cfg.window_start_s is not None:
        raise ValueError(
            "client_id and window_start_s select ServeGen rows; the Azure trace has neither"
        )
    if (cfg.median_prompt_tokens, cfg.prompt_tokens_sigma) != (
        _PROMPT_DEFAULTS.median_prompt_tokens,
        _PROMPT_DEFAULTS.prompt_tokens_sigma,
    ):  # (they were accepted, recorded in meta.importer and ignored)
        raise ValueError(
            "median_prompt_tokens and prompt_tokens_sigma draw ServeGen's prompt lengths; the "
            "Azure trace's prompts are its measured ContextTokens"
        )
    context, generated = read_azure(path)
    cap = cfg.max_response_tokens or int(generated.max())
    warn_small_pool(path, generated, cfg)
    rng = np.random.default_rng(cfg.seed)
    lengths = group_by_rank(rng, np.minimum(generated, cap), cfg)
    prompt_tokens = rng.choice(context, size=(cfg.num_steps, cfg.prompts_per_step), replace=True)
    model = f"unknown (Azure LLM inference 2023, {kind.removeprefix('azure-')} service)"
    return trace_from_arrays(
        lengths, prompt_tokens, _meta(kind, path, cfg, cap, model, AZURE_ATTRIBUTION)
    )


def import_trace(kind: str, path: str | Path, cfg: ImportConfig) -> Trace:
    """Dispatch on ``kind`` (one of ``KINDS``)."""
    if kind == "servegen":
        return import_servegen(path, cfg)
    if kind in ("azure-code", "azure-conv"):
        return import_azure(path, cfg, kind)
    raise ValueError(f"unknown source kind {kind!r}: expected one of {', '.join(KINDS)}")

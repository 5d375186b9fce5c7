"""``OUT/generations.jsonl`` of ``tltrun generate``, written as the responses finish, so that a
killed run keeps every finished response and ``tltrun generate --out OUT --resume`` generates
only the others.

Each row is one response: ``{"id", "prompt_token_ids", "output_token_ids", "finish",
"accept_hist"}`` (+ ``"text"`` with the character tokenizer). While the run goes the rows are
in the order the responses finished; the finished run rewrites the file in request order (a
temporary file replacing it whole). A kill mid-row leaves a torn last line, which a resume drops.

    log = GenerationsLog(out / "generations.jsonl", tokenizer)
    done = log.resume(requests)        # --resume: the ids already written (checked)
    log.append(outputs)                # after every engine step with finished responses
    log.finish([r.id for r in requests])
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tltrun.rollout.interface import Request, RequestOutput
from tltrun.train.state import write_jsonl_atomic
from tltsim.errors import UsageError
from tltsim.jsonio import parse_json


class GenerationsLog:
    """The rows written so far (``rows``: id -> row) and the open file they go to."""

    def __init__(self, path: Path, tokenizer: Any = None):
        self.path = path
        self.tokenizer = tokenizer
        self.rows: dict[str, dict[str, Any]] = {}
        self._file = None

    def start(self) -> None:
        """A fresh run: an empty file."""
        self._file = self.path.open("w")

    def resume(self, requests: list[Request]) -> set[str]:
        """A killed run's rows (a torn last line cut off), each checked against ``requests``
        (its id is one of theirs, with the same prompt: the prompt file has not changed);
        returns their ids, and appends from there."""
        ids = [r.id for r in requests]
        if len(set(ids)) != len(ids):
            raise UsageError(
                f"{self.path}: cannot resume: the prompt file has repeated ids, so its "
                "finished responses cannot be told apart"
            )
        prompts = {r.id: list(r.prompt_token_ids) for r in requests}
        data = self.path.read_bytes() if self.path.is_file() else b""
        whole = data[: data.rfind(b"\n") + 1]  # a line without its newline was cut by the kill
        for lineno, line in enumerate(whole.decode("utf-8", "replace").splitlines(), start=1):
            where = f"{self.path} line {lineno}"
            row = parse_json(line, where)
            if not isinstance(row, dict) or not isinstance(row.get("id"), str):
                raise UsageError(f"{where}: expected a response object with a string 'id'")
            if row["id"] not in prompts:
                raise UsageError(f"{where}: not a response of this run's prompts")
            _check_row(row, where)
            if row.get("prompt_token_ids") != prompts[row["id"]]:
                raise UsageError(
                    f"{where}: the prompt of {row['id']!r} differs from the prompt file's (the "
                    "file changed since the run started); restore it, or start a new run"
                )
            self.rows[row["id"]] = row
        if len(whole) < len(data):
            with self.path.open("r+b") as f:
                f.truncate(len(whole))
        self._file = self.path.open("a")
        return set(self.rows)

    def append(self, outputs: list[RequestOutput]) -> None:
        """Write ``outputs`` (finished responses) and flush them to the OS."""
        for o in outputs:
            row = {
                "id": o.id,
                "prompt_token_ids": list(o.prompt_token_ids),
                "output_token_ids": o.output_token_ids,
                "finish": o.finish,
                "accept_hist": o.accept_hist,
            }
            if self.tokenizer is not None:
                row["text"] = self.tokenizer.decode(o.output_token_ids)
            self.rows[o.id] = row
            self._file.write(json.dumps(row) + "\n")
        if outputs:
            self._file.flush()

    def finish(self, request_ids: list[str]) -> None:
        """Every response written: the file again, in request order, replacing it whole."""
        self.close()
        write_jsonl_atomic(self.path, [self.rows[rid] for rid in request_ids])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def _check_row(row: dict[str, Any], where: str) -> None:
    """The fields a resume reads back (a hand-edited or damaged row was a traceback later)."""
    tokens = row.get("output_token_ids")
    if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
        raise UsageError(f"{where}: 'output_token_ids' must be a list of token ids (ints >= 0)")
    if row.get("finish") not in ("stop", "length"):
        raise UsageError(f"{where}: 'finish' must be 'stop' or 'length', got {row.get('finish')!r}")
    hist = row.get("accept_hist")
    if not isinstance(hist, list) or not all(type(n) is int and n >= 0 for n in hist):
        raise UsageError(f"{where}: 'accept_hist' must be a list of counts (ints >= 0)")


__all__ = ["GenerationsLog"]

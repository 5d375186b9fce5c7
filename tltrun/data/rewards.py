"""Rewards for ``tltrun train``: a small registry of verifiable rewards, scored in a pool of
worker processes with a per-call timeout, plus optional, documented reward shaping.

``--reward`` kinds (``parse_reward``). Every kind but ``builtin`` and a user function reads only
the response's final part (``scoring.final_part``): what follows its last ``</think>``; a
response whose thinking never closed (opened in it, or by the prompt's template) has no answer
(0.0, not well formed).

* ``builtin`` — the built-in long-tail task's reward (``tltrun.train.tasks.reward``): 1.0 iff the
  response's last non-empty line is ``answer: N`` with N the integer answer field.
* ``math`` — math-verify (``math_verify.parse`` / ``verify``, the Hugging Face Math-Verify
  library): the response's final answer is the content of its last ``\\boxed{...}`` if it has
  one, else what math-verify extracts from the whole response (a "final answer is ..." anchor,
  else the last number or expression); the answer field is parsed the same way, after the last
  ``####`` when it has one (the GSM8K convention). 1.0 if they are mathematically equal
  (``\\boxed{3/4}`` vs ``0.75`` -> 1.0), else 0.0. An answer field that math-verify cannot parse
  is an error (scored 0, reported).
* ``exact`` — normalized string match: the response's final answer (the last ``\\boxed{}``
  content if present, else its last non-empty line) and the answer field, each stripped, with
  whitespace runs collapsed to one space, casefolded and trailing periods removed; 1.0 if equal.
* ``regex:<pattern>`` — the named group ``answer`` of the pattern's LAST match in the response
  (e.g. ``regex:Answer:\\s*(?P<answer>\\S+)``), compared with the answer field like ``exact``; no
  match -> 0.0.
* ``reasoning-gym:<task>`` — the task's own scorer (``dataset.score_answer(answer, entry)``, in
  [0, 1], partial credit where the task gives it). The response's answer is reasoning-gym's
  ``extract_answer`` of it (the last ``<answer>...</answer>``), else the whole response stripped.
  The entry is regenerated from the row's ``meta["reasoning_gym"]`` coordinates when the data
  came from ``--data reasoning-gym:...``, else rebuilt as ``{"question": prompt, "answer":
  answer field, "metadata": meta.get("metadata", {})}``.
* ``path/to/module.py:function`` — a user's function ``function(prompt, response, answer,
  **meta) -> float``: ``prompt`` is the prompt text (chat messages as ``role: content`` lines),
  ``answer`` the answer field as a string (or None), ``meta`` the row's other columns (keys named
  prompt, response or answer are left out). It must return a finite number (a bool counts as 0
  or 1); anything else is an error. The module is imported once in a child process by
  ``parse_reward`` (to fail early: a module that raises, exits or hangs at import is one line)
  and once in each reward process.

Errors and timeouts: each call runs in a ``RewardPool`` process with a timeout (``--reward-timeout-s``,
default 10 s). A reward that raises, returns a bad value, or runs past the timeout (its process
is killed and replaced) scores 0 with ``RewardOutcome.error`` set ("timeout after 10 s",
"ValueError: ...") — or, with ``on_error="raise"`` (``--reward-errors=raise``), ends the batch with
a ``RewardError`` naming the sample id.

The reward functions themselves live in ``scoring.py`` (``Scorer``), which a reward process
loads; this module holds ``--reward`` parsing, the pool and the shaping.

Shaping (off by default; ``Shaping``, ``apply_shaping``): DAPO's overlong reward shaping (Yu et
al., "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", arXiv 2503.14476, Sec. 3.4,
eq. 13): with L_max the response cap and L_cache the buffer, a response of |y| tokens gets
0 if |y| <= L_max - L_cache, ((L_max - L_cache) - |y|) / L_cache inside the buffer, and -1 past
L_max, times ``overlong_penalty``, added to its reward; and a format penalty subtracted when the
response lacks the form its reward looks for (``RewardOutcome.is_format_ok``: a ``\\boxed{}`` for
math and exact, a match for regex, ``<answer>`` tags for reasoning-gym, an ``answer: N`` last
line for builtin; user functions are always well-formed).
"""

from __future__ import annotations

import contextlib
import inspect
import io
import math
import multiprocessing
import os
import signal
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

from tltrun.data.scoring import (
    RESERVED_ARGS,
    REWARD_KINDS,
    RewardItem,
    RewardOutcome,
    RewardSpec,
    Scorer,
    compile_answer_pattern,
    load_user_function,
    one_line,
    score_one,
)
from tltsim.errors import UsageError
from tltsim.lifetime import die_with_parent

__all__ = [
    "REWARD_KINDS",
    "RewardError",
    "RewardItem",
    "RewardOutcome",
    "RewardPool",
    "RewardSpec",
    "Shaping",
    "apply_shaping",
    "parse_reward",
]

ON_ERROR_CHOICES = ("zero", "raise")
# A reward process loads its function before it takes work (math-verify ~1 s, reasoning-gym
# ~2 s on this 2-core machine, measured while writing this); the bound only catches a process that
# never comes up, so it is generous rather than measured.
STARTUP_TIMEOUT_S = 120.0


class RewardError(UsageError):
    """A reward that failed with ``on_error="raise"``, or that cannot be loaded; one line."""


@dataclass(frozen=True, kw_only=True)
class Shaping:
    """Reward shaping, off by default (module docstring: DAPO eq. 13 and the format penalty).
    ``overlong_buffer_tokens`` is DAPO's L_cache (0 = off); ``overlong_penalty`` scales eq. 13.
    veRL's DAPO recipe scripts (volcengine/verl ``recipe/dapo/*.sh``: ``overlong_buffer_len =
    1024 * 4``, ``overlong_penalty_factor = 1.0``) are the setting to copy when turning it on;
    the paper's own buffer size was not re-checked here. ``format_penalty`` is subtracted from a
    response that lacks the reward's form (0 = off)."""

    overlong_buffer_tokens: int = 0
    overlong_penalty: float = 1.0
    format_penalty: float = 0.0

    def __post_init__(self) -> None:
        if self.overlong_buffer_tokens < 0:
            raise UsageError(
                f"--overlong-buffer-tokens: expected >= 0, got {self.overlong_buffer_tokens}"
            )
        for name in ("overlong_penalty", "format_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise UsageError(
                    f"--{name.replace('_', '-')}: expected a finite number >= 0, got {value}"
                )


def apply_shaping(
    reward: float,
    *,
    num_response_tokens: int,
    max_response_tokens: int,
    shaping: Shaping,
    is_format_ok: bool = True,
) -> float:
    """``reward`` plus DAPO's overlong term (eq. 13, scaled by ``overlong_penalty``) minus the
    format penalty for a response without the reward's form. Identity with the default Shaping."""
    out = reward
    buffer = shaping.overlong_buffer_tokens
    if buffer > 0:
        if buffer > max_response_tokens:
            raise UsageError(
                f"--overlong-buffer-tokens {buffer}: larger than the max response length "
                f"({max_response_tokens} tokens)"
            )
        expected = max_response_tokens - buffer  # L_max - L_cache
        if num_response_tokens > max_response_tokens:
            overlong = -1.0
        elif num_response_tokens > expected:
            overlong = (expected - num_response_tokens) / buffer
        else:
            overlong = 0.0
        out += shaping.overlong_penalty * overlong
    if not is_format_ok:
        out -= shaping.format_penalty
    return out


# --- parsing --reward ---------------------------------------------------------------------------


def is_python_reward(text: str) -> bool:
    """Whether ``--reward`` text names a user's ``path/to/module.py:function``."""
    path, sep, _ = text.strip().rpartition(":")
    return bool(sep) and path.endswith(".py")


def parse_reward(
    text: str, *, flag: str = "--reward", is_module_checked: bool = True
) -> RewardSpec:
    """``--reward`` text -> RewardSpec, checked now (pattern compiled, task known, module imported
    and its function found) so a bad value fails before any worker starts. ``flag``: where the
    text came from, for the error (``--data`` when a reasoning-gym task's own reward is implied).
    ``is_module_checked=False`` skips the user module's import (a caller whose launcher checked
    it: a RewardPool's processes import it anyway)."""
    text = text.strip()
    kind, _, arg = text.partition(":")
    if text in ("builtin", "math", "exact"):
        return RewardSpec(kind=text)
    if kind == "regex":
        compile_answer_pattern(arg)
        return RewardSpec(kind="regex", arg=arg)
    if kind == "reasoning-gym":
        from tltrun.data.gym import check_task

        check_task(arg, what=f"{flag} reasoning-gym task")
        return RewardSpec(kind="reasoning-gym", arg=arg)
    path, _, function = text.rpartition(":")
    if is_python_reward(text):
        spec = RewardSpec(kind="python", arg=f"{Path(path).resolve()}:{function}")
        if is_module_checked:
            check_user_function(spec.arg)
        return spec
    raise UsageError(
        f"--reward {text!r}: expected builtin, math, exact, regex:<pattern>, "
        f"reasoning-gym:<task> or path/to/module.py:function"
    )


def check_user_function(arg: str, meta_keys: tuple[str, ...] | None = None) -> None:
    """Import the user's module and find its function in a child process: a module that hangs
    at import fails after STARTUP_TIMEOUT_S, one that exits (``sys.exit``, argparse at module
    level) fails with its exit, each as one UsageError; the launcher never runs the module's
    top-level code itself. With ``meta_keys`` (the data's other columns), a function that
    cannot take (prompt, response, answer, **those) is one UsageError too: it failed on every
    call, and the run trained on zero rewards with nothing said but a count in log.jsonl."""
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    process = context.Process(
        target=_check_import, args=(arg, sender, meta_keys, os.getpid()), daemon=True
    )
    process.start()
    sender.close()
    try:
        if not receiver.poll(STARTUP_TIMEOUT_S):
            raise UsageError(
                f"--reward {arg}: importing the module did not finish within "
                f"{STARTUP_TIMEOUT_S:g} s (does it do work at import time?)"
            )
        status, message = receiver.recv()
    except EOFError:  # the process died without a word: a crash in native code
        process.join(5)
        raise UsageError(
            f"--reward {arg}: importing the module ended its process (exit code {process.exitcode})"
        ) from None
    finally:
        receiver.close()
        if process.is_alive():
            process.kill()
        process.join()
    if status != "ok":
        raise UsageError(message)


def _check_import(
    arg: str, conn: Connection, meta_keys: tuple[str, ...] | None, parent_pid: int
) -> None:
    """``check_user_function``'s child: ("ok", "") or ("failed", one line). What the module
    prints while importing is kept, and a failure quotes its last line (argparse's usage error).
    It ends with the launcher (a module that hangs at import outlived a killed one)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    printed = io.StringIO()
    message = ""
    with contextlib.redirect_stdout(printed), contextlib.redirect_stderr(printed):
        try:
            function = load_user_function(arg)
            if inspect.iscoroutinefunction(function) or inspect.isgeneratorfunction(function):
                kind = "an async" if inspect.iscoroutinefunction(function) else "a generator"
                raise UsageError(  # (it failed on every call: "returned coroutine")
                    f"--reward {arg}: {kind} function; the reward is a plain function "
                    "returning a float"
                )
            if meta_keys is not None:
                _check_signature(arg, function, meta_keys)
        except UsageError as err:
            message = str(err)
        except BaseException as err:  # the user's module: SystemExit included
            message = f"--reward {arg}: importing the module failed: {one_line(err)}"
    lines = [line.strip() for line in printed.getvalue().splitlines() if line.strip()]
    if message and lines:
        message += f" (it printed: {lines[-1][:200]})"
    conn.send(("failed", message) if message else ("ok", ""))
    conn.close()


def _check_signature(arg: str, function: Any, meta_keys: tuple[str, ...]) -> None:
    """The call ``Scorer`` makes, bound without running it (a signature inspect cannot read,
    e.g. a C function's, passes)."""
    try:
        signature = inspect.signature(function)
    except (TypeError, ValueError):
        return
    meta = {key: None for key in meta_keys if key not in RESERVED_ARGS}
    try:
        signature.bind("prompt", "response", "answer", **meta)
    except TypeError as err:
        columns = f" and the data's other columns as keywords ({', '.join(meta)})" if meta else ""
        hint = " (add **kwargs to take the columns it does not use)" if meta else ""
        raise UsageError(
            f"--reward {arg}: the function is called with (prompt, response, answer){columns}: "
            f"{err}{hint}"
        ) from None


def _worker_main(spec: RewardSpec, conn: Connection, parent_pid: int) -> None:
    """A reward process: load the function, say ready, then score items until told to stop or
    until the parent goes away (EOF). Ctrl-C is the parent's to handle; the parent's death (a
    rank stopped by SIGTERM or SIGKILL runs no ``close``) ends it too: a busy or hung reward
    process stayed behind, re-parented, spinning its CPU forever."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent(parent_pid)
    try:
        scorer = Scorer(spec)
    except Exception as err:
        conn.send(("failed", one_line(err)))
        return
    conn.send(("ready",))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        if message is None:
            return
        index, item = message
        try:
            outcome = score_one(scorer, item)
        except (SystemExit, GeneratorExit):
            raise  # (the pool says the process died, with its exit code)
        except BaseException as err:  # the user function's own KeyboardInterrupt (this process
            # ignores SIGINT) or BaseException: said per sample (only "process died" was said)
            outcome = RewardOutcome(reward=0.0, error=one_line(err))
        try:
            conn.send(("done", index, outcome))
        except (BrokenPipeError, OSError):  # the parent went away mid-call
            return


# --- the pool -------------------------------------------------------------------------------------


class _Slot:
    """One reward process and what it is doing: starting, idle, or busy with one item."""

    def __init__(self, context: Any, spec: RewardSpec) -> None:
        self.conn, child_conn = context.Pipe(duplex=True)
        self.process = context.Process(
            target=_worker_main,
            args=(spec, child_conn, os.getpid()),
            daemon=True,
            name="tlt-reward",
        )
        self.process.start()
        # The parent keeps only its end, so the child's death reads as EOF here.
        child_conn.close()
        self.is_ready = False
        self.started_s = time.monotonic()
        self.index: int | None = None
        self.deadline_s = math.inf

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5.0)
        self.conn.close()


class RewardPool:
    """Scores responses in ``num_processes`` processes (multiprocessing "spawn" context: the
    caller is a torch worker, which must not fork) with a ``timeout_s`` per call. A call that
    hangs has its process killed and replaced — a ProcessPoolExecutor cannot kill one task —
    and the pool keeps working for the next call. Use as a context manager, or call close()."""

    def __init__(
        self,
        spec: RewardSpec,
        *,
        num_processes: int = 1,
        # math-verify's parse and verify each stop themselves after 5 s (their defaults), so
        # 10 s lets a slow but finite math check finish; it is a bound, not a measurement.
        timeout_s: float = 10.0,
        on_error: str = "zero",
    ) -> None:
        if num_processes < 1:
            raise UsageError(f"--reward-processes: expected >= 1, got {num_processes}")
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UsageError(f"--reward-timeout-s: expected a positive number, got {timeout_s}")
        if on_error not in ON_ERROR_CHOICES:
            raise UsageError(
                f"--reward-errors: expected one of {ON_ERROR_CHOICES}, got {on_error!r}"
            )
        self.spec = spec
        self.timeout_s = timeout_s
        self.on_error = on_error
        self.num_errors = 0
        self._context = multiprocessing.get_context("spawn")
        self._slots = [_Slot(self._context, spec) for _ in range(num_processes)]
        self._closed = False

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop every reward process (politely, then by kill after 5 s)."""
        if self._closed:
            return
        self._closed = True
        for slot in self._slots:
            with contextlib.suppress(OSError, ValueError):  # already dead: killed below
                slot.conn.send(None)
        for slot in self._slots:
            slot.process.join(timeout=5.0)
            slot.kill()

    def score(self, items: Sequence[RewardItem]) -> list[RewardOutcome]:
        """The outcome of each item, in order. Failures score 0 with ``error`` set; with
        ``on_error="raise"`` the batch is finished (so the pool stays consistent) and then the
        first failure is raised as a RewardError naming its sample id."""
        if self._closed:
            raise RuntimeError("RewardPool.score after close()")
        outcomes: list[RewardOutcome | None] = [None] * len(items)
        todo = deque(range(len(items)))
        while todo or any(slot.index is not None for slot in self._slots):
            for i, slot in enumerate(self._slots):
                if slot.is_ready and slot.index is None and todo:
                    index = todo.popleft()
                    try:
                        slot.conn.send((index, items[index]))
                    except OSError:  # it died idle since the last call (BrokenPipeError)
                        todo.appendleft(index)
                        self._replace(i, outcomes, "")  # (no item of its: nothing failed)
                        continue
                    slot.index = index
                    slot.deadline_s = time.monotonic() + self.timeout_s
            self._wait_and_collect(outcomes)
        done = [outcome for outcome in outcomes if outcome is not None]
        assert len(done) == len(items)
        failed = [(item, o) for item, o in zip(items, done, strict=True) if o.error is not None]
        self.num_errors += len(failed)
        if failed and self.on_error == "raise":
            item, outcome = failed[0]
            raise RewardError(
                f"reward {self.spec} failed on sample {item.sample_id}: {outcome.error} "
                f"({len(failed)} of {len(items)} failed; --reward-errors=zero scores them 0)"
            )
        return done

    def _wait_and_collect(self, outcomes: list[RewardOutcome | None]) -> None:
        """Wait for a message or the next deadline; record results, replace dead or hung
        processes."""
        now = time.monotonic()
        deadlines = [slot.deadline_s for slot in self._slots if slot.index is not None]
        deadlines += [
            slot.started_s + STARTUP_TIMEOUT_S for slot in self._slots if not slot.is_ready
        ]
        timeout = max(0.0, min(deadlines) - now) if deadlines else None
        ready = wait([slot.conn for slot in self._slots], timeout=timeout)
        for i, slot in enumerate(self._slots):
            if slot.conn in ready:
                try:
                    message = slot.conn.recv()
                except (EOFError, OSError):
                    died = f"reward process died (exit code {self._exit_code(slot)})"
                    if not slot.is_ready:
                        # Dying before "ready" is a loading failure, which a new process repeats.
                        self.close()
                        raise RewardError(f"reward {self.spec}: {died} while loading") from None
                    self._replace(i, outcomes, died)
                    continue
                if message[0] == "ready":
                    slot.is_ready = True
                elif message[0] == "failed":
                    self.close()
                    raise RewardError(
                        f"reward {self.spec}: cannot load in a reward process: {message[1]}"
                    )
                else:
                    _, index, outcome = message
                    outcomes[index] = outcome
                    slot.index = None
                    slot.deadline_s = math.inf
        now = time.monotonic()
        for i, slot in enumerate(self._slots):
            if slot.index is not None and now >= slot.deadline_s:
                self._replace(i, outcomes, f"timeout after {self.timeout_s:g} s")
            elif not slot.is_ready and now >= slot.started_s + STARTUP_TIMEOUT_S:
                self.close()
                raise RewardError(
                    f"reward {self.spec}: a reward process did not start within {STARTUP_TIMEOUT_S:g} s"
                )

    def _replace(self, i: int, outcomes: list[RewardOutcome | None], error: str) -> None:
        slot = self._slots[i]
        if slot.index is not None:
            outcomes[slot.index] = RewardOutcome(reward=0.0, error=error)  # as score_one
        slot.kill()
        self._slots[i] = _Slot(self._context, self.spec)

    @staticmethod
    def _exit_code(slot: _Slot) -> int | None:
        slot.process.join(timeout=1.0)
        return slot.process.exitcode

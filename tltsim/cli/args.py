"""Helpers that map frozen config dataclasses 1:1 onto argparse flags (``tltsim`` and ``tltrun``).

Every subcommand builds its flags from a config dataclass (STYLE.md: "CLI flags are generated
from, or mapped 1:1 onto, those fields"), so a flag and its field can never drift apart. Bad
values become ``tltsim.errors.UsageError``, which each CLI's ``main`` prints as one line.

Both CLIs' ``main`` also share ``OneLineParser`` (an argparse usage error is one ``error:``
line, not a usage block) and ``run_command`` (the one place that turns exceptions into exit
codes: ``TLTError`` and OS errors on a named file -> one ``error:`` line and 2, Ctrl-C -> 130,
anything else -> one ``error: internal error`` line, exit 1, traceback in a file).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import traceback
import types
import typing
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tqdm import tqdm

from tltsim.errors import TLTError, UsageError
from tltsim.jsonio import closest


class OneLineParser(argparse.ArgumentParser):
    """An ArgumentParser whose usage errors are one ``error:`` line (exit 2) like every other
    input error of the CLIs; ``--help`` still prints the full usage. A flag is spelt in full:
    argparse's abbreviations took ``advise --hardware H100-SXM`` for ``--hardware-file`` and
    answered about a preset file, and a new flag sharing a prefix would change what an old
    abbreviation means."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # subcommands' parsers are built here too
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):  # (the words error() looks at)
        self.words = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> typing.NoReturn:
        if message.endswith("expected one argument") and any(
            len(word) > 1 and word[0] == "-" and word[1] in "0123456789."
            for word in getattr(self, "words", sys.argv[1:])
        ):  # argparse takes "-8,16" (not a plain negative number) for a flag
            message += " (a value that starts with '-' is written --flag=VALUE)"
        prog = self.prog
        if message.startswith("unrecognized arguments: "):
            prog, message = self._unknown_flag(message)
        self.exit(2, f"error: {prog}: {message} (see {prog} --help)\n")

    def _unknown_flag(self, message: str) -> tuple[str, str]:
        """The subcommand's name and the flag of it closest to the first unknown one: the top
        parser reports unrecognized arguments, and 'see tltsim --help' lists no flag."""
        words = getattr(self, "words", sys.argv[1:])
        parser: argparse.ArgumentParser = self
        for action in self._actions:  # argparse keeps the subcommands' parsers there
            if isinstance(action, argparse._SubParsersAction):
                parser = next((action.choices[w] for w in words if w in action.choices), self)
        # the names without '--' (with them, --bogus was one letter from --out)
        unknown = [w.split("=")[0][2:] for w in message.split(": ", 1)[1].split() if w[:2] == "--"]
        names = [o[2:] for a in parser._actions for o in a.option_strings if o[:2] == "--"]
        # one flag the typed word begins (an abbreviation): that one, before the closest
        begun = [n for n in names if unknown and n.startswith(unknown[0])]
        guess = begun[0] if len(begun) == 1 else (closest(unknown[0], names) if unknown else None)
        return parser.prog, message + (f" (did you mean --{guess}?)" if guess else "")


class Terminated(BaseException):
    """SIGTERM, raised where the command was (``run_command(..., is_sigterm_handled=True)``), so
    that its ``with`` blocks close what they opened: a sweep's pool was left to the
    multiprocessing resource tracker, which printed 'leaked semaphore' lines after the exit."""


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def stop_in(err: BaseException) -> BaseException | None:
    """The Ctrl-C or SIGTERM behind ``err``: itself, or one a library's clean-up raised over
    (SIGTERM inside torch.save: its zip writer's exit raised "unexpected pos", and the stop was
    reported as an internal error)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, KeyboardInterrupt | Terminated):
            return err
        seen.add(id(err))
        err = err.__context__
    return None


def run_command(
    func: Callable[[argparse.Namespace], Any],
    args: argparse.Namespace,
    prog: str,
    is_sigterm_handled: bool = False,
) -> int:
    """Run a subcommand; every failure ends as one ``error:`` line on stderr. Input errors
    (``TLTError``; ``OSError`` naming a file, e.g. disk full or permission denied while writing
    results) exit 2; Ctrl-C exits 130; SIGTERM, where handled here, 143; any other exception is
    a bug: exit 1 and its traceback goes to a file named in the line, so the terminal never
    shows a traceback."""
    created = _missing_out_dirs(args)
    previous = signal.signal(signal.SIGTERM, _raise_terminated) if is_sigterm_handled else None
    try:
        try:
            with warnings.catch_warnings():
                warnings.showwarning = _show_warning
                return int(func(args) or 0)
        except BaseException:
            _erase_progress_bars()
            _remove_if_empty(created)
            raise
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
    except Terminated:
        print("stopped by SIGTERM", file=sys.stderr)
        return 143
    except TLTError as err:
        if getattr(err, "is_output_cut", False):
            print(file=sys.stderr)  # end the line a killed worker's progress bar left open
        print(f"error: {err}", file=sys.stderr)
        return getattr(err, "exit_code", 2)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # the reader went away (`| head`): stop quietly as a pipeline expects, 128 + SIGPIPE;
        # stdout goes to /dev/null so the flush at exit cannot raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except OSError as err:
        if err.filename is None:
            return _internal_error(err, prog)
        print(f"error: {err.filename}: {err.strerror or err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - the last line of defence, reported as a bug
        stop = stop_in(err)
        if stop is not None:
            is_term = isinstance(stop, Terminated)
            print("stopped by SIGTERM" if is_term else "interrupted", file=sys.stderr)
            return 143 if is_term else 130
        return _internal_error(err, prog)


def _missing_out_dirs(args: argparse.Namespace) -> list[Path]:
    """The directories of ``--out`` (itself, or the folder of an output file) that do not exist
    yet, deepest first: a command that fails removes those it created and left empty."""
    out = getattr(args, "out", None)
    if not isinstance(out, str | Path) or not str(out):
        return []
    missing, path = [], Path(out).absolute()
    while not path.exists() and path != path.parent:
        missing.append(path)
        path = path.parent
    return missing


def _remove_if_empty(dirs: list[Path]) -> None:
    """A refused command leaves no empty output directory behind (it used to, wherever the
    command created ``--out`` before a check of its input failed)."""
    for path in dirs:
        if not path.is_dir():  # never created (an output file's own name, or not reached)
            continue
        try:
            path.rmdir()  # only an empty directory: anything the command wrote stays
        except OSError:
            return


def _erase_progress_bars() -> None:
    """Close the progress bars a failed command left open, erasing their lines: otherwise the
    error line is written onto the bar's line and the bar is drawn again after it at exit."""
    # tqdm's registry of open bars, the one tqdm.write clears and redraws
    for bar in list(getattr(tqdm, "_instances", ())):
        bar.leave = False
        bar.close()


def check_out_dir(path: str | Path, flag: str = "--out", kind: str | None = None) -> Path:
    """Create the output directory ``path`` up front, so that a run never fails after its work
    when it comes to write: an existing file, a parent that is a file or an unwritable place is
    one UsageError naming the flag. With ``kind`` (the command), a directory holding another
    tltsim command's results is refused too: each command removes only its own earlier files,
    so an advice beside a replay's summary.json was drawn by ``report`` as that replay."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    other = None if kind is None else results_kind(path)
    if other is not None and other[0] != kind:
        what = other[0] if " " in other[0] else f"the results of a tltsim {other[0]}"
        raise UsageError(
            f"{flag} {path}: holds {what} ({other[1]}); give this {kind} a directory of its own "
            "(or remove that one)"
        )
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UsageError(f"{flag} {path}: cannot create the directory ({err.strerror})") from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: directory is not writable")
    return path


def results_kind(path: Path) -> tuple[str, str] | None:
    """Which tltsim command wrote the results in ``path`` (its config.json's "kind"; advise
    writes advise.json), or, in words, a model or a tltrun run (tltrun.train.resumable's
    ``written_by``), and the file that says so; None for anything else."""
    if (path / "advise.json").is_file():
        return "advise", "advise.json"
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        kind = config.get("kind")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    if kind in ("replay", "sweep", "compare"):
        return kind, "config.json"
    # a model's, or a tltrun run's (its section names the command): written over, it was lost
    if "model_type" in config:
        return "a model", "config.json"
    run = next((key for key in ("generate", "bench", "train") if key in config), None)
    return (f"the results of a tltrun {run}", "config.json") if run else None


def check_out_file(path: str | Path, flag: str = "--out", file_format: str | None = None) -> Path:
    """Like ``check_out_dir`` for an output file: not a directory, its directory writable. With
    ``file_format`` (the format the command writes: ``tlt-hardware``, ``tlt-trace``, ...), an
    existing file of another format is refused (hunt: ``calibrate --out`` a trace, or a
    replay's summary.json, replaced it)."""
    path = Path(path)
    if path.is_dir():
        raise UsageError(f"{flag} {path}: is a directory, expected a file name")
    if file_format is not None and path.is_file() and path.stat().st_size:
        found = file_format_of(path)
        if found is not None and found != file_format:
            held = f"a {found} file" if found else "a file of another kind"
            raise UsageError(
                f"{flag} {path}: holds {held}, not a {file_format} file; choose another name "
                "(or remove it)"
            )
    check_out_dir(path.parent, flag=f"{flag} {path}: directory")
    return path


def file_format_of(path: Path) -> str | None:
    """The ``format`` a JSON file names ("" where it names none, or is no JSON), ``tlt-profile``
    for a profile CSV ("" for another CSV); None where it cannot tell without reading a large
    file whole: a JSON over 64 MiB is told by a ``format`` key in its first MiB (a trace's
    comes first), else left unchecked (review: a 300 MB trace of one's own was refused)."""
    try:
        if path.suffix.lower() == ".csv":
            with path.open(encoding="utf-8", errors="replace") as fh:
                return "tlt-profile" if fh.readline().startswith("op,batch,") else ""
        if path.stat().st_size > 2**26:
            with path.open("rb") as fh:
                head = fh.read(2**20).decode("utf-8", errors="replace")
            found = re.search(r'"format"\s*:\s*"([^"\\]+)"', head)
            return found[1] if found else None
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return ""
    is_named = isinstance(doc, dict) and isinstance(doc.get("format"), str)
    return doc["format"] if is_named else ""


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning of tltsim or tltrun (a legal but suspicious input) as one ``warning:`` line;
    a third-party warning as Python prints it."""
    if category.__module__.partition(".")[0] in ("tltsim", "tltrun"):
        print(f"warning: {message}", file=sys.stderr)
    else:
        _PYTHON_SHOWWARNING(message, category, filename, lineno, file, line)


_PYTHON_SHOWWARNING = warnings.showwarning


def _internal_error(err: BaseException, prog: str) -> int:
    with tempfile.NamedTemporaryFile(
        "w", prefix=f"{prog}-traceback-", suffix=".txt", delete=False
    ) as f:
        traceback.print_exception(err, file=f)
    first = str(err).splitlines()[0] if str(err) else ""
    print(
        f"error: internal error: {type(err).__name__}: {first} (full traceback in {f.name})",
        file=sys.stderr,
    )
    return 1


def _base_type(tp: Any) -> Any:
    """``int | None`` -> int; ``tuple[int, ...]`` -> tuple; plain types unchanged."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _base_type(args[0]) if len(args) == 1 else str
    return origin or tp


def flag_name(field: dataclasses.Field, prefix: str = "") -> str:
    """``--{prefix}{field-name}``; a boolean field (``None`` allowed: a default resolved later)
    drops its ``is_`` (``is_spot_training`` -> ``--spot-training/--no-spot-training``): the
    prefix names Python booleans, not options."""
    name = field.name
    if field.type in (bool, "bool", "bool | None") and name.startswith("is_"):
        name = name.removeprefix("is_")
    return "--" + prefix + name.replace("_", "-")


def _metavar(field: dataclasses.Field, tp: Any) -> str:
    """What ``--help`` shows as the flag's value: ``metadata["metavar"]``, the choices of
    ``metadata["choices"]`` (shown only; ``__post_init__`` validates), else the type."""
    if "metavar" in field.metadata:
        return field.metadata["metavar"]
    if "choices" in field.metadata:
        return "{" + ",".join(map(str, field.metadata["choices"])) + "}"
    return {int: "N", float: "X", tuple: "LIST", list: "LIST"}.get(tp, "NAME")


def add_dataclass_args(
    parser: argparse.ArgumentParser,
    cls: type,
    prefix: str = "",
    skip: tuple[str, ...] = (),
    default_text: str | None = None,
) -> None:
    """Add one flag per field of dataclass ``cls`` except ``skip`` (:func:`flag_name`; every
    flag's default is None = not given). The help line is the field's ``metadata["help"]`` plus
    its default, or ``default_text`` where the default comes from elsewhere (a measured trace's
    recorded settings); ``metadata["metavar"]`` / ``metadata["choices"]`` name the value (else
    N, X, NAME or LIST by type). The flag's ``dest`` is ``prefix + field.name``."""
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name.startswith("_") or not f.init or f.name in skip:
            continue
        flag = flag_name(f, prefix)
        tp = _base_type(hints[f.name])
        default = f.default if f.default is not dataclasses.MISSING else None
        if isinstance(default, tuple):  # shown as typed; () shows none (the help says what)
            default = ",".join(map(str, default))
        if default_text is not None:
            default = default_text
        helptext = f.metadata.get("help", "") + (
            f" (default: {default})" if default not in (None, "") else ""
        )
        if tp is bool:
            group.add_argument(
                flag,
                dest=prefix + f.name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help=helptext,
            )
        elif tp in (tuple, list):
            group.add_argument(
                flag,
                dest=prefix + f.name,
                default=None,
                metavar=_metavar(f, tp),
                help=helptext + " (comma-separated)",
            )
        else:
            group.add_argument(
                flag,
                dest=prefix + f.name,
                type=tp if tp in (int, float, str) else str,
                default=None,
                metavar=_metavar(f, tp),
                help=helptext,
            )


# Field names that are also words of the validation messages ("the policy", "its data"):
# dataclass_from_args does not turn them into flags.
PROSE_WORDS = frozenset({"out", "policy", "data", "model", "device", "backend", "dtype", "reward",
                         "hardware", "sampling", "instance", "placement", "exact"})  # fmt: skip


def dataclass_from_args(
    cls: type, ns: argparse.Namespace, prefix: str = "", base: Any = None
) -> Any:
    """Build ``cls`` from flags parsed by :func:`add_dataclass_args` (dest ``prefix +
    field.name``, so ``--no-spot-training`` lands on ``is_spot_training``); fields whose flag was
    not given keep ``base``'s value (or the dataclass default). Validation errors from
    ``__post_init__`` become UsageError."""
    values = {
        f.name: getattr(base, f.name)
        for f in dataclasses.fields(cls)
        if f.init and base is not None
    }
    given = given_fields(cls, ns, prefix)
    values.update(given)
    try:
        return cls(**values)
    except (TypeError, ValueError) as err:
        # __post_init__ messages name their class already ("TLTConfig: ..."); say it once
        text = str(err).removeprefix(f"{cls.__name__}: ")
        said = _said_with_flags(text, cls, ns, prefix, base, given)
        raise UsageError(said if said != text else f"{cls.__name__}: {text}") from None


def _said_with_flags(
    text: str, cls: type, ns: argparse.Namespace, prefix: str, base: Any, given: dict[str, Any]
) -> str:
    """A validation message with the flags a user typed for the fields it names
    ("eval_split must be in [0, 1)" -> "--eval-split ..."). A setting ``base`` changed (a
    --config file's key) keeps its name, and so do field names that are also plain words of
    the messages (and of paths): ``PROSE_WORDS``, unless the message opens with one (its
    subject: "policy must be one of ...")."""
    flags = {
        f.name: flag_name(f, prefix)
        for f in dataclasses.fields(cls)
        if hasattr(ns, prefix + f.name) and (f.name in given or not _is_changed_by(base, f))
    }
    subject = re.match(r"[a-z][a-z0-9_]* (?=must )", text)  # "policy must be one of ..."
    if subject is not None and subject[0].strip() in flags:
        text = flags[subject[0].strip()] + text[subject.end() - 1 :]
    flags = {name: flag for name, flag in flags.items() if name not in PROSE_WORDS}
    # TrainConfig's tlt_* fields are a TLTConfig's, whose own message names them bare
    body = text.removeprefix("TLTConfig: ")
    nested = "tlt_" if body != text else ""

    def flag(m: re.Match) -> str:
        return flags.get(m[0]) or flags.get(nested + m[0], m[0])

    # a quoted word is a value ("got 'seed'"), a word in a path or file name no field; one
    # word is a field only in the subject, before the verb ("strategies" after "must be" is
    # prose), a field_with_underscores anywhere
    word = r"(?<![-./\w'\"])[a-z][a-z0-9_]*\b(?![./'\"])"
    verb = re.search(r" must | required| need|: | \(|;| got ", body)
    cut = len(body) if verb is None else verb.start()
    said = re.sub(word, flag, body[:cut]) + re.sub(
        word, lambda m: flag(m) if "_" in m[0] else m[0], body[cut:]
    )
    return said if said != body else text


def _is_changed_by(base: Any, f: dataclasses.Field) -> bool:
    """Whether ``base`` holds another value of field ``f`` than its default."""
    if base is None or not hasattr(base, f.name):
        return False
    if f.default is not dataclasses.MISSING:
        return getattr(base, f.name) != f.default
    if f.default_factory is not dataclasses.MISSING:
        return getattr(base, f.name) != f.default_factory()
    return True


def given_fields(cls: type, ns: argparse.Namespace, prefix: str = "") -> dict[str, Any]:
    """The fields of ``cls`` whose flag was given, as field values (a comma list as a tuple);
    not validated together (``cls`` may apply them over another instance's)."""
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        raw = getattr(ns, prefix + f.name, None)
        if raw is None:
            continue
        tp = _base_type(hints[f.name])
        if tp in (tuple, list) and isinstance(raw, str):
            inner = typing.get_args(hints[f.name])
            elem = inner[0] if inner and inner[0] is not Ellipsis else str
            items = raw.split(",") if raw != "" else []
            if "" in items:  # (nospec,,tlt was read as nospec,tlt)
                raise UsageError(f"{flag_name(f, prefix)}: an empty item in {raw!r}")
            try:
                raw = tuple(elem(x) for x in items)
            except ValueError:
                raise UsageError(
                    f"{flag_name(f, prefix)}: expected comma-separated {elem.__name__} values, got {raw!r}"
                ) from None
        values[f.name] = raw
    return values

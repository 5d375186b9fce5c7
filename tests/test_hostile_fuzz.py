"""Hypothesis fuzzing of ``tltsim``'s inputs (issue #17, beside tests/test_hostile.py's named
cases): hostile values anywhere inside a valid trace, hostile bytes in every trace format, hostile
numbers in replay's numeric flags. Each run either succeeds or ends as exactly one ``error:``
line with exit code 2: never a traceback, an ``internal error`` or a hang.

Run: ``python -m pytest tests/test_hostile_fuzz.py -q``.
"""

from __future__ import annotations

import gzip
import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_hostile import assert_one_error_line, files, run, trace_json  # noqa: F401 (a fixture)

JSON_LEAVES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 10**30]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
)
JSON_VALUES = st.recursive(
    JSON_LEAVES,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _replace_at(doc: object, path: list[int], value: object) -> object:
    """``doc`` with the node reached by following ``path`` (indices modulo each container's
    size) replaced by ``value``: hostile values anywhere inside a valid trace."""
    if not path or not isinstance(doc, (list, dict)) or not doc:
        return value
    if isinstance(doc, list):
        i = path[0] % len(doc)
        return [_replace_at(v, path[1:], value) if j == i else v for j, v in enumerate(doc)]
    key = list(doc)[path[0] % len(doc)]
    return {k: _replace_at(v, path[1:], value) if k == key else v for k, v in doc.items()}


def _assert_ok_or_one_error(rc: int, out: str, err: str) -> None:
    assert rc in (0, 2), f"exit {rc}: {err[-800:]}"
    assert "Traceback" not in out + err and "internal error" not in err, err[-800:]
    if rc == 2:
        assert_one_error_line(rc, out, err)


@FUZZ
@given(path=st.lists(st.integers(0, 7), max_size=8), value=JSON_VALUES)
def test_fuzz_trace_values(path, value, tmp_path, capsys):
    doc = _replace_at(json.loads(trace_json()), path, value)
    file = tmp_path / "fuzz.json"
    file.write_text(json.dumps(doc))  # NaN / Infinity are written as JSON's non-standard tokens
    _assert_ok_or_one_error(*run("tltsim", ["validate", str(file)], capsys))


@FUZZ
@given(
    data=st.one_of(
        st.binary(max_size=300),
        st.builds(lambda n, b: b"[" * n + b, st.integers(0, 5000), st.binary(max_size=20)),
        st.builds(lambda n: b'{"a":' * n, st.integers(900, 20_000)),
    ),
    suffix=st.sampled_from([".json", ".json.gz", ".csv", ".parquet"]),
)
def test_fuzz_trace_bytes(data, suffix, tmp_path, capsys):
    file = tmp_path / f"fuzz{suffix}"
    file.write_bytes(gzip.compress(data) if suffix == ".json.gz" and data[:1] == b"[" else data)
    _assert_ok_or_one_error(*run("tltsim", ["validate", str(file)], capsys))


REPLAY_NUMERIC_FLAGS = (
    "--num-gpus",
    "--tp",
    "--max-running-requests",
    "--tail-threshold",
    "--seed",
    "--max-steps",
    "--tlt-threshold",
    "--tlt-epsilon",
    "--tlt-explore-iters",
    "--drafter-max-accept-rate",
    "--spot-max-epochs",
    "--spot-startup-s",
)
HOSTILE_NUMBERS = st.one_of(
    st.sampled_from(
        ["nan", "inf", "-inf", "-1", "0", "1e309", str(2**63), str(2**63 - 1), str(10**30), "", "x"]
    ),
    st.integers(-3, 16).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
)


@FUZZ
@given(
    flags=st.lists(st.tuples(st.sampled_from(REPLAY_NUMERIC_FLAGS), HOSTILE_NUMBERS), max_size=3)
)
def test_fuzz_replay_numeric_flags(flags, files, tmp_path, capsys):  # noqa: F811
    argv = ["replay", files["trace"], "--policy", "nospec,tlt", "--out", str(tmp_path / "o")]
    for flag, value in flags:
        argv += [f"{flag}={value}"]  # = keeps a value like -1 from reading as a flag
    _assert_ok_or_one_error(*run("tltsim", argv, capsys))

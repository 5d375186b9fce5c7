"""float16's range (65,504): weights beyond it are refused at load, and a prompt whose logits
overflow is one error naming its request. Both used to run: the cast made the weight inf after
the load's finiteness check, and the sampler drew token 0 from NaN probabilities every time
(a hunt's finding: ``generate --dtype float16`` wrote all-zero responses, exit 0).

Run: ``python -m pytest tests/test_dtype_range.py -q``.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
from tiny_models import tiny_model

from tltrun.cli.main import main
from tltrun.model.config import CheckpointError
from tltrun.model.drafter import EagleDrafter, export_vllm, load_drafter
from tltrun.model.hf_checkpoint import load_hf, save_hf
from tltrun.rollout.engine import RolloutEngine
from tltrun.rollout.engine_config import EngineConfig
from tltrun.rollout.interface import NonFiniteLogitsError, Request, SamplingParams
from tltsim.policy import NoSpec


@pytest.fixture(scope="module")
def big_weight_dir(tmp_path_factory):
    """A float32 checkpoint with one norm weight of 1e5: fine in float32 and bfloat16."""
    model = tiny_model(seed=0)
    with torch.no_grad():
        model.model.norm.weight[0] = 1e5
    root = tmp_path_factory.mktemp("big") / "model"
    save_hf(model, root)
    return root


def test_a_weight_beyond_float16s_range_is_refused_naming_it(big_weight_dir):
    with pytest.raises(CheckpointError, match=r"'model\.norm\.weight' holds values up to 1e\+05"):
        load_hf(big_weight_dir, dtype=torch.float16)
    for dtype in (torch.float32, torch.bfloat16):  # their range holds it
        weight = float(load_hf(big_weight_dir, dtype=dtype).model.norm.weight[0].detach())
        assert weight == pytest.approx(1e5, rel=2**-8)  # bfloat16's 8-bit mantissa


def test_a_drafter_weight_beyond_float16s_range_is_refused(tmp_path):
    target = tiny_model(seed=0)
    drafter = EagleDrafter.for_target(target, seed=1)
    with torch.no_grad():
        drafter.fc.weight[0, 0] = 7e4
    export_vllm(drafter, tmp_path / "d")
    with pytest.raises(CheckpointError, match=r"'fc\.weight' holds values up to 7e\+04.*float16"):
        load_drafter(tmp_path / "d", target.half())
    load_drafter(tmp_path / "d", tiny_model(seed=0))  # float32: loads


def overflowing_model():
    """Finite float16 weights whose activations overflow: logits ~1e5."""
    model = tiny_model(seed=0)
    with torch.no_grad():
        model.lm_head.weight.mul_(10.0)
        model.model.norm.weight.mul_(1e4)
    return model


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_logits_that_overflow_at_prefill_name_the_request(temperature):
    model = overflowing_model()
    config = EngineConfig(
        max_running_requests=4,
        max_model_len=64,
        sampling=SamplingParams(temperature=temperature),
        dtype="float16",
    )
    # two samples of one prompt (a GRPO group): the leader's prefill stops the rollout
    requests = [Request(f"r{i}", (5, 6, 7, 8), 6, ignore_eos=True, prompt_id="p") for i in range(2)]
    engine = RolloutEngine(copy.deepcopy(model), None, config)
    with pytest.raises(NonFiniteLogitsError, match=r"request r0: .* NaN or inf in float16"):
        engine.generate(requests, NoSpec())
    # float32 holds the same activations: it runs
    config32 = EngineConfig(max_running_requests=4, max_model_len=64, dtype="float32")
    out = RolloutEngine(copy.deepcopy(model), None, config32).generate(requests, NoSpec())
    assert [len(o.output_token_ids) for o in out.outputs] == [6, 6]


def test_generate_float16_on_a_weight_beyond_its_range_is_one_line(
    big_weight_dir, tmp_path, capsys
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        json.dumps({"id": "p0", "prompt_token_ids": [5, 6, 7], "max_new_tokens": 4}) + "\n"
    )
    argv = ["generate", "--model", str(big_weight_dir), "--prompts", str(prompts)]
    argv += ["--out", str(tmp_path / "g"), "--max-model-len", "32", "--dtype", "float16"]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'model.norm.weight' holds values up to 1e+05" in err[0], err

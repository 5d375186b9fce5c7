"""A user's own model in ``tltsim``: ``--model`` takes a Hugging Face config.json or model
directory besides the presets (replay, sweep specs, advise); mixture-of-experts configs are
refused, not priced as dense.

Run: ``python -m pytest tests/test_model_path.py -q``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from tltsim.cli.main import main
from tltsim.cost.specs import ModelSpec, get_model
from tltsim.sim.sweep import run_sweep

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT / "traces" / "azure_conv_rl.json"

# Qwen3-4B's published config.json (huggingface.co/Qwen/Qwen3-4B), the fields the cost model reads
QWEN3_4B = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "head_dim": 128,
    "hidden_size": 2560,
    "intermediate_size": 9728,
    "model_type": "qwen3",
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}


def model_dir(root: Path, name: str = "Qwen3-4B", config: dict | None = None) -> Path:
    path = root / name
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config or QWEN3_4B))
    return path


def test_get_model_reads_a_config_file_or_a_model_directory(tmp_path):
    directory = model_dir(tmp_path)
    by_dir, by_file = get_model(str(directory)), get_model(str(directory / "config.json"))
    assert by_dir == by_file and by_dir.name == "Qwen3-4B"
    assert by_dir.head_dim == 128 and by_dir.num_kv_heads == 8 and not by_dir.has_qkv_bias
    assert by_dir.tie_word_embeddings
    assert get_model("Qwen2.5-7B").name == "Qwen2.5-7B"  # presets unchanged
    with pytest.raises(ValueError, match="no config.json there"):
        get_model(str(tmp_path))
    with pytest.raises(ValueError, match="unknown model preset 'Qwen3-4B'.*config.json"):
        get_model("Qwen3-4B")  # a name that is neither a preset nor a path here


@pytest.mark.parametrize(
    ("key", "value"),
    [("num_experts", 128), ("num_local_experts", 8), ("n_routed_experts", 256),
     ("moe_num_experts", 64)],  # ERNIE-4.5's
)  # fmt: skip
def test_a_mixture_of_experts_config_is_refused(key, value):
    with pytest.raises(ValueError, match=f"'{key}' = {value}: a mixture-of-experts model"):
        ModelSpec.from_hf_config({**QWEN3_4B, key: value})
    assert ModelSpec.from_hf_config({**QWEN3_4B, key: 0}).num_layers == 36  # "no experts"
    nested = {**QWEN3_4B, "ffn_config": {"moe_num_experts": 16}}  # DBRX's layout
    with pytest.raises(ValueError, match="'moe_num_experts' = 16: a mixture-of-experts"):
        ModelSpec.from_hf_config(nested)


@pytest.mark.parametrize(
    ("change", "says"),
    [
        ({"head_dim": [128]}, "field 'head_dim' must be an integer in [1, 2^31), got [128]"),
        ({"num_key_value_heads": 0}, "'num_key_value_heads' must be an integer in [1, 2^31), got 0"),
        ({"num_key_value_heads": "8"}, "'num_key_value_heads' must be an integer"),
        ({"quantization_config": {"quant_method": "fp8"}}, "a quantized checkpoint"),
    ],
)  # fmt: skip
def test_config_fields_the_cost_model_cannot_price_are_one_line_errors(tmp_path, change, says):
    directory = model_dir(tmp_path, config={**QWEN3_4B, **change})
    with pytest.raises(ValueError) as err:
        get_model(str(directory))
    assert str(err.value).startswith(f"{directory / 'config.json'}: ")
    assert says in str(err.value) and "config.json: config.json" not in str(err.value)


def test_a_users_checkpoint_is_priced_in_the_rollouts_bf16_and_text_config_is_read(tmp_path):
    fp32 = get_model(str(model_dir(tmp_path, "fp32", {**QWEN3_4B, "torch_dtype": "float32"})))
    assert fp32.bytes_per_param == 2  # an FSDP-merged fp32 save: rolled out in bf16 all the same
    text = {k: v for k, v in QWEN3_4B.items() if k != "vocab_size"}
    multimodal = {"model_type": "gemma3", "vocab_size": 151936, "text_config": text}
    spec = get_model(str(model_dir(tmp_path, "mm", multimodal)))
    assert spec.vocab_size == 151936 and spec.num_layers == 36  # the top level's vocabulary
    del multimodal["vocab_size"]
    with pytest.raises(ValueError, match="text_config: missing field 'vocab_size'"):
        get_model(str(model_dir(tmp_path, "mm2", multimodal)))


def test_replay_with_a_model_directory(tmp_path, capsys):
    directory = model_dir(tmp_path)
    out = tmp_path / "r"
    argv = ["replay", str(TRACE), "--model", str(directory), "--max-steps", "1"]
    assert main([*argv, "--policy", "nospec", "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    model = config["cost_model"]["model"]
    assert model["name"] == "Qwen3-4B" and model["num_layers"] == 36
    # the same replay of the 7B preset is slower: the 4B model was priced, not the default
    assert main(["replay", str(TRACE), "--max-steps", "1", "--policy", "nospec", "--out",
                 str(tmp_path / "7b")]) == 0  # fmt: skip
    # what was priced, and the model the lengths came from (the trace's meta names another)
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("simulated: Qwen3-4B on 8 x H100-SXM (TP 1); the trace's meta")
    assert "meta names model 'unknown (Azure LLM inference 2023, conv service)'" in first
    four_b = json.loads((out / "summary.json").read_text())["policies"][0]["mean_step_s"]
    seven_b = json.loads((tmp_path / "7b" / "summary.json").read_text())["policies"][0]
    assert four_b < seven_b["mean_step_s"]
    capsys.readouterr()
    assert main(["replay", str(TRACE), "--model", str(tmp_path / "nope.json")]) == 2
    assert "nope.json: cannot read a JSON config" in capsys.readouterr().err


def test_a_sweep_reads_the_model_beside_its_spec_and_recomputes_when_it_changes(
    tmp_path, monkeypatch
):
    here = tmp_path / "study"
    model_dir(here)
    spec = f"""
trace = "{TRACE}"
max_steps = 1
out = "o"
[fixed]
num_gpus = 4
[grid]
policy = ["static"]
model = ["Qwen3-4B", "Qwen2.5-7B"]
"""
    (here / "spec.toml").write_text(spec)
    monkeypatch.chdir(tmp_path)  # not the spec's directory
    first = run_sweep(Path("study") / "spec.toml", workers=1)
    assert first.num_computed == 4  # 2 models x (static + its NoSpec)
    models = set(first.table["model"])
    assert models == {str(here / "Qwen3-4B"), "Qwen2.5-7B"}
    (here / "Qwen3-4B" / "config.json").write_text(
        json.dumps({**QWEN3_4B, "num_hidden_layers": 72})
    )
    again = run_sweep(Path("study") / "spec.toml", workers=1)
    assert again.num_computed == 2 and again.num_reused == 2  # the preset's rows kept
    deeper = again.table[again.table["model"] != "Qwen2.5-7B"]
    shallower = first.table[first.table["model"] != "Qwen2.5-7B"]
    assert (deeper.mean_step_s.to_numpy() > shallower.mean_step_s.to_numpy()).all()
    # the same spec named from its own directory: the model's rows are reused (their keys held
    # a path relative to wherever the sweep ran)
    monkeypatch.chdir(here)
    assert run_sweep(Path("spec.toml"), workers=1).num_computed == 0


def test_advise_on_a_users_model_and_cluster(tmp_path, capsys):
    directory = model_dir(tmp_path)
    out = tmp_path / "advise"
    argv = ["advise", str(TRACE), "--max-steps", "1", "--num-seeds", "1", "--thresholds", "32"]
    argv += ["--strategy-sets", "chains", "--workers", "1", "--out", str(out)]
    assert main([*argv, "--model", str(directory / "config.json"), "--num-gpus", "16"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("simulated: Qwen3-4B on 16 x H100-SXM (TP 1)\n")
    report = json.loads((out / "advise.json").read_text())
    model = str(directory / "config.json")
    assert report["sim"]["num_gpus"] == 16 and report["sim"]["model"] == model
    assert report["model"]["num_layers"] == 36 and report["hardware"]["name"] == "H100-SXM"
    assert 'model = "' + model + '"' in (out / "sweep.toml").read_text()
    sweep = pd.read_csv(out / "sweep" / "sweep.csv")
    assert set(sweep.num_gpus) == {16} and set(sweep.model) == {model}
    assert main([*argv, "--tp", "3"]) == 2  # 8 GPUs of the preset: checked before the sweep
    err = capsys.readouterr().err
    assert "advise --preset h100x8-qwen7b --tp 3: num_gpus=8 is not a multiple of tp=3" in err
    assert not (out / "sweep.toml").read_text().count("tp =")  # the refused run wrote nothing


def test_weights_that_do_not_fit_are_refused_and_kv_overflow_is_warned(tmp_path, capsys):
    """Memory was not checked: a 70B model at TP 1 on an 80 GB GPU was simulated (2.29x), and
    256 long responses per GPU decoded at once past its KV capacity, without a word."""
    assert main(["replay", str(TRACE), "--model", "Llama-3.1-70B", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "Llama-3.1-70B at TP 1 on H100-SXM: 143.1 GB of weights per GPU" in err
    assert "raise --tp" in err
    # one step of 64 prompts x 8 responses of 30,000 tokens on one GPU: 15.6M KV tokens at once
    from tltsim.trace.files import save_trace
    from tltsim.trace.schema import Prompt, Response, Step, Trace

    long = Response(tokens=30_000)
    prompts = tuple(Prompt(id=f"p{i}", prompt_tokens=500, responses=(long,) * 8) for i in range(64))
    trace = tmp_path / "long.json"
    save_trace(Trace(meta={}, steps=(Step(step=0, prompts=prompts),)), trace)
    argv = ["replay", str(trace), "--num-gpus", "1", "--policy", "nospec"]
    assert main([*argv, "--out", str(tmp_path / "r")]) == 0
    err = capsys.readouterr().err
    assert "warning: nospec: one instance held up to 15,616,000 KV tokens at once" in err
    steps = pd.read_csv(tmp_path / "r" / "steps.csv")
    assert steps.peak_kv_tokens.tolist() == [64 * 8 * 30_500]
    # 16 at once fit (16 x 30,500 = 488,000 tokens): no warning
    assert main([*argv, "--max-running-requests", "16", "--out", str(tmp_path / "r16")]) == 0
    assert "KV tokens" not in capsys.readouterr().err

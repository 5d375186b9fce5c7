"""Roofline cost model: preset numbers, monotonicity, closed forms vs loops, SD crossover.

Run: .venv/bin/python -m pytest tests/test_costmodel.py -q
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tltsim.cost.roofline import CostModel, RooflineCost, sum_max_linear
from tltsim.cost.specs import (
    HARDWARE_PRESETS,
    MODEL_PRESETS,
    DrafterSpec,
    ModelSpec,
    get_hardware,
    get_model,
)
from tltsim.policy import SpecDecision
from tltsim.sim.acceptance import expected_accept_len

TLT_STRATEGIES = ("8_4_48", "8_4_32", "8_4_16", "8_4_8")


def fitting_cost(model_name: str, hardware_name: str) -> RooflineCost:
    """Smallest power-of-two TP whose GPUs hold the weights in 60% of their memory."""
    model, hardware = get_model(model_name), get_hardware(hardware_name)
    tp = 1
    while model.num_params * model.bytes_per_param > 0.6 * hardware.memory_bytes * tp:
        tp *= 2
    return RooflineCost(model, hardware, tp=tp)


costs = st.builds(
    lambda m, h, tp_exp: RooflineCost(
        get_model(m), get_hardware(h), tp=min(2**tp_exp, get_model(m).num_kv_heads)
    ),
    st.sampled_from(sorted(MODEL_PRESETS)),
    st.sampled_from(sorted(HARDWARE_PRESETS)),
    st.integers(0, 3),
)
decisions = st.sampled_from(
    [SpecDecision.parse(s) for s in (*TLT_STRATEGIES, "4_1_4", "6_10_60", "3_2_6")]
)


# --- specs ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "billions", "digits"),
    [
        # Model cards: Qwen2.5-0.5B 0.49B, 1.5B 1.54B, 7B 7.61B; Llama-3.1-8B 8.03B, 70B 70.6B.
        ("Qwen2.5-0.5B", 0.49, 2),
        ("Qwen2.5-1.5B", 1.54, 2),
        ("Qwen2.5-7B", 7.61, 2),
        ("Llama-3.1-8B", 8.03, 2),
        ("Qwen3-8B", 8.2, 1),  # card (as quoted by third parties): 8.2B
        ("Llama-3.1-70B", 70.6, 1),
    ],
)
def test_preset_parameter_counts_match_model_cards(name, billions, digits):
    # Cards print rounded or truncated figures: agree to within one unit of the last digit.
    assert get_model(name).num_params / 1e9 == pytest.approx(billions, abs=10**-digits)


def test_qwen32b_parameter_count_exact():
    # Counted from the published config.json (embedding and LM head untied, q/k/v biases).
    assert get_model("Qwen2.5-32B").num_params == 32_763_876_352


def test_kv_bytes_per_token_qwen7b():
    # 2 (K, V) x 28 layers x 4 KV heads x 128 dims x 2 bytes
    assert get_model("Qwen2.5-7B").kv_bytes_per_token == 57_344


QWEN32B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 5120,
    "intermediate_size": 27648,
    "max_position_embeddings": 131072,
    "model_type": "qwen2",
    "num_attention_heads": 40,
    "num_hidden_layers": 64,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 152064,
}


def test_from_hf_config_reproduces_preset():
    assert ModelSpec.from_hf_config(QWEN32B_CONFIG, name="Qwen2.5-32B") == get_model("Qwen2.5-32B")


def test_from_hf_config_nested_text_config_and_llama_bias():
    cfg = {
        "text_config": {
            "model_type": "llama",
            "attention_bias": False,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_hidden_layers": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
        }
    }
    assert ModelSpec.from_hf_config(cfg, name="Llama-3.1-8B") == get_model("Llama-3.1-8B")


def test_from_hf_config_missing_field_names_it(tmp_path):
    cfg = dict(QWEN32B_CONFIG)
    del cfg["vocab_size"]
    path = tmp_path / "m" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"config\.json.*'vocab_size'"):
        ModelSpec.from_hf_config_file(path)


def test_eagle_drafter_layout():
    target = get_model("Qwen2.5-7B")
    drafter = DrafterSpec(target)
    h = target.hidden_size
    assert drafter.trainable_params == 2 * h * h + h + target.layer_params
    assert drafter.matmul_params == drafter.trainable_params + target.vocab_size * h
    # The shared LM head is most of what a drafter forward streams for a 152k vocabulary.
    assert drafter.lm_head_params > drafter.matmul_params / 2
    assert drafter.kv_bytes_per_token == target.kv_bytes_per_token // target.num_layers


def test_bad_specs_raise():
    with pytest.raises(ValueError, match="not divisible by tp"):
        RooflineCost(get_model("Qwen2.5-7B"), get_hardware("H100-SXM"), tp=3)
    with pytest.raises(ValueError, match="unknown model preset"):
        get_model("GPT-5")


# --- roofline iteration time ---------------------------------------------------------------------


def test_roofline_cost_implements_protocol():
    assert isinstance(fitting_cost("Qwen2.5-7B", "H100-SXM"), CostModel)


def test_small_batch_decode_is_weight_bandwidth_bound():
    cost = fitting_cost("Qwen2.5-7B", "H100-SXM")
    hw = cost.hardware
    weights_s = get_model("Qwen2.5-7B").weight_bytes / hw.achievable_bytes_per_s
    assert cost.decode_iter_s(1, 100) == pytest.approx(weights_s + hw.iter_overhead_s, rel=0.01)


def test_a_prefill_computes_the_lm_head_for_each_sequences_last_token_only():
    """A compute-bound prefill of 8 x 1,024 tokens: its FLOPs are the layers' over every token
    and the LM head's over 8 (it was charged on all 8,192: +8% on Qwen2.5-7B)."""
    model = get_model("Qwen2.5-7B")
    cost = RooflineCost(model, get_hardware("H100-SXM"), max_prefill_chunk_tokens=1 << 20)
    n, seqs = 8192, 8
    pairs = n * (n / seqs + 1) / 2
    flops = (
        2.0 * (model.matmul_params - model.lm_head_params) * n
        + 2.0 * model.lm_head_params * seqs
        + model.attn_flops_per_pair * pairs
    )
    compute_s = flops / cost.hardware.achievable_flops_per_s
    assert cost.prefill_s(n, 0.0, seqs) == pytest.approx(
        compute_s + cost.hardware.iter_overhead_s, rel=1e-9
    )


@settings(max_examples=150, deadline=None)
@given(
    cost=costs,
    batch=st.integers(1, 512),
    ctx=st.floats(0, 32768),
    t=st.integers(1, 64),
)
def test_more_batch_context_or_tokens_never_lowers_iteration_time(cost, batch, ctx, t):
    base = cost.decode_iter_s(batch, batch * ctx, t)
    assert cost.decode_iter_s(batch + 1, (batch + 1) * ctx, t) >= base
    assert cost.decode_iter_s(batch, batch * ctx + 1000, t) >= base
    assert cost.decode_iter_s(batch, batch * ctx, t + 1) >= base
    assert cost.drafter_iter_s(batch + 1, (batch + 1) * ctx, t) >= cost.drafter_iter_s(
        batch, batch * ctx, t
    )


@settings(max_examples=150, deadline=None)
@given(
    a0=st.floats(-1e3, 1e3),
    a1=st.floats(-10, 10),
    b0=st.floats(-1e3, 1e3),
    b1=st.floats(-10, 10),
    n=st.integers(0, 400),
)
def test_sum_max_linear_equals_loop(a0, a1, b0, b1, n):
    loop = math.fsum(max(a0 + a1 * i, b0 + b1 * i) for i in range(n))
    assert sum_max_linear(a0, a1, b0, b1, n) == pytest.approx(loop, rel=1e-9, abs=1e-6)


@settings(max_examples=100, deadline=None)
@given(cost=costs, batch=st.integers(1, 256), ctx=st.floats(0, 2e6), n=st.integers(0, 3000))
def test_decode_span_closed_form_equals_loop(cost, batch, ctx, n):
    loop = math.fsum(cost.decode_iter_s(batch, ctx + i * batch, 1) for i in range(n))
    assert cost.decode_span_s(batch, ctx, n) == pytest.approx(loop, rel=1e-9, abs=1e-12)


def test_decode_span_crosses_from_bandwidth_to_compute_bound():
    # A batch whose context grows long enough for the KV read to overtake the weights:
    # the closed form must still match the loop across the regime change.
    cost = fitting_cost("Qwen2.5-0.5B", "H20")
    loop = math.fsum(cost.decode_iter_s(128, 1000 + i * 128, 1) for i in range(5000))
    assert cost.decode_span_s(128, 1000, 5000) == pytest.approx(loop, rel=1e-9)


@settings(max_examples=60, deadline=None)
@given(
    cost=costs,
    decision=decisions,
    batch=st.integers(1, 64),
    ctx=st.floats(0, 1e6),
    n=st.integers(0, 300),
    growth=st.floats(1, 500),
)
def test_sd_span_closed_form_equals_loop(cost, decision, batch, ctx, n, growth):
    loop = math.fsum(cost.sd_iter_s(batch, ctx + i * growth, decision) for i in range(n))
    got = cost.sd_span_s(batch, ctx, decision, n, growth)
    assert got == pytest.approx(loop, rel=1e-9, abs=1e-12)


@settings(max_examples=150, deadline=None)
@given(cost=costs, decision=decisions, batch=st.integers(1, 512), ctx=st.floats(0, 32768))
def test_sd_with_one_token_per_verify_never_cheaper_than_plain(cost, decision, batch, ctx):
    # A useless drafter (no candidate of any rank accepted): one token per request per SD
    # iteration, as plain decoding.
    assert expected_accept_len(decision, 0.0, sibling_rate=0.0) == 1.0
    assert cost.sd_iter_s(batch, batch * ctx, decision) >= cost.decode_iter_s(batch, batch * ctx)


@pytest.mark.parametrize("model_name", sorted(MODEL_PRESETS))
@pytest.mark.parametrize("hardware_name", sorted(HARDWARE_PRESETS))
def test_crossover_exists_and_grows_as_verify_tokens_shrink(model_name, hardware_name):
    # Short contexts (512 tokens per request): verification, not the KV read, dominates.
    cost = fitting_cost(model_name, hardware_name)
    crossovers = []
    for name in TLT_STRATEGIES:
        decision = SpecDecision.parse(name)
        accept = expected_accept_len(decision, 0.8)
        crossovers.append(cost.crossover_batch(decision, accept, 512, max_batch=2048))
    if model_name == "Qwen3-1.7B":
        # Except a model whose KV cache is large for its weights (112 KB per token for 1.7B
        # parameters): at large batches its decode is KV-bound and the KV read is shared by all
        # verify tokens, so small trees pay up to (and beyond) the batch its memory can hold;
        # the largest tree still stops paying. (Its memory holds 656 (L40S) to 2,172 (H200)
        # requests of 512 tokens.)
        assert cost.kv_capacity_tokens() // 512 < 2200
        while crossovers and crossovers[-1] is None:
            crossovers.pop()
        assert len(crossovers) >= 2, crossovers
    assert None not in crossovers, crossovers
    assert crossovers == sorted(crossovers) and len(set(crossovers)) == len(crossovers), crossovers


def test_crossover_grows_with_fixed_accept_length():
    cost = fitting_cost("Qwen2.5-7B", "H100-SXM")
    found = [
        cost.crossover_batch(SpecDecision.parse(f"8_4_{v}"), 4.0, 1024) for v in (48, 32, 16, 8)
    ]
    assert None not in found and found == sorted(found) and found[0] < found[-1]
    # Below the crossover SD is faster, at it slower.
    d, b = SpecDecision.parse("8_4_48"), found[0]
    assert 4.0 * cost.decode_iter_s(b - 1, (b - 1) * 1024) >= cost.sd_iter_s(
        b - 1, (b - 1) * 1024, d
    )
    assert 4.0 * cost.decode_iter_s(b, b * 1024) < cost.sd_iter_s(b, b * 1024, d)


# --- prefill, switch, training ---------------------------------------------------------------------


def test_prefill_is_compute_bound_and_cheaper_split_over_requests():
    cost = fitting_cost("Qwen2.5-7B", "H100-SXM")
    model, hw = cost.model, cost.hardware
    matmul_s = 2 * model.matmul_params * 8192 / hw.achievable_flops_per_s
    assert cost.prefill_s(8192) > matmul_s
    # Same tokens as 32 requests: less causal attention than one 8k sequence.
    assert cost.prefill_s(8192, 0.0, 32) < cost.prefill_s(8192, 0.0, 1)
    assert cost.prefill_s(0) == 0.0
    assert cost.prefill_s(16384) > cost.prefill_s(8192)


def test_sd_switch_costs_more_than_target_reprefill_alone():
    cost = fitting_cost("Qwen2.5-7B", "H100-SXM")
    assert cost.sd_switch_s(16, 16 * 4000) > cost.prefill_s(16 * 4000, 0.0, 16) > 0
    assert cost.sd_switch_s(16, 0.0) == 0.0


def test_train_time_linear_in_tokens_and_recompute():
    model, hw = get_model("Qwen2.5-7B"), get_hardware("H100-SXM")
    cost = RooflineCost(model, hw)
    assert cost.train_s(2_000_000) == pytest.approx(2 * cost.train_s(1_000_000))
    expected = (3 * 8 / 6 + 1) * 2 * model.matmul_params * 1e6 / (hw.peak_flops_per_s * 0.4)
    assert cost.train_s(1_000_000) == pytest.approx(expected)
    no_recompute = RooflineCost(model, hw, recompute_factor=1.0)
    assert no_recompute.train_s(1_000_000) < cost.train_s(1_000_000)
    assert cost.train_s(1_000_000, mean_seq_tokens=16384) > cost.train_s(1_000_000)
    assert RooflineCost(model, hw, tp=2).train_s(1_000_000) == pytest.approx(cost.train_s(500_000))


def test_drafter_training_much_cheaper_than_actor_training():
    cost = fitting_cost("Qwen2.5-32B", "H100-SXM")
    assert cost.drafter_train_s(1_000_000, 512) < 0.5 * cost.train_s(1_000_000, 512)
    harvested = RooflineCost(cost.model, cost.hardware, tp=cost.tp, is_drafter_target_forward=False)
    assert harvested.drafter_train_s(1_000_000) < cost.drafter_train_s(1_000_000)


def test_kv_capacity():
    assert fitting_cost("Qwen2.5-7B", "H100-SXM").kv_capacity_tokens() > 500_000
    assert RooflineCost(get_model("Llama-3.1-70B"), get_hardware("L40S")).kv_capacity_tokens() == 0
    # tp 4 over 2 KV heads: each GPU holds a whole head, so 4 GPUs hold what 2 would per token
    # (it counted them as split 4 ways: twice the tokens)
    small = get_model("Qwen2.5-1.5B")
    assert small.num_kv_heads == 2
    tp4 = RooflineCost(small, get_hardware("H100-SXM"), tp=4)
    per_token = 2 * (small.kv_bytes_per_token + tp4.drafter_spec.kv_bytes_per_token)
    free = (
        4 * tp4.hardware.memory_bytes * 0.9
        - (small.num_params + tp4.drafter_spec.trainable_params) * small.bytes_per_param
    )
    assert tp4.kv_capacity_tokens() == int(free // per_token)
    assert tp4.decode_span_s(4, 4000, -3) == 0.0  # no iterations: no time (it was negative)

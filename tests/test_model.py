"""tltrun.model.transformer matches transformers' Llama/Qwen2/Qwen3 logits on the same weights (fp32, <= 1e-4),
loads single-file and sharded checkpoints, and round-trips through save_hf.

Run: ``python -m pytest tests/test_model.py -q -s`` (``-s`` shows the max abs diffs).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from tiny_models import cuda_param

from tltrun.model.config import CheckpointError, ModelConfig, read_config
from tltrun.model.hf_checkpoint import load_hf, save_hf
from tltrun.model.transformer import CausalContext, fuse_projections

transformers = pytest.importorskip("transformers")

TOL = 1e-4

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def _hf_model(kind: str, *, kv_heads: int, tied: bool, rope: dict | None = None, seed: int = 0):
    torch.manual_seed(seed)
    common = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        eos_token_id=2,
        bos_token_id=1,
        initializer_range=0.1,  # larger than HF's 0.02 so a wrong RoPE/bias shows well above TOL
    )
    if kind == "llama":
        cfg = transformers.LlamaConfig(**common, rope_scaling=rope, rope_theta=500000.0)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(cfg)
    else:  # head_dim 24, not hidden / heads = 16: Qwen3's configs give it apart
        cfg = transformers.Qwen3Config(**common, head_dim=24, rope_scaling=rope)
        model = transformers.Qwen3ForCausalLM(cfg)
    # Random (not zero) q/k/v biases so the Qwen2 bias path is exercised, and norm weights
    # (not ones) so a wrong or missing Qwen3 q/k norm shows.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model.eval()


def _ours_vs_hf(hf_model, model_dir) -> float:
    ours = load_hf(model_dir, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 40), generator=gen)
    pos = torch.arange(40).expand(3, 40)
    with torch.no_grad():
        want = hf_model(input_ids=ids).logits
        got, hidden = ours(ids, pos, CausalContext())
        fused, _ = fuse_projections(ours)(ids, pos, CausalContext())  # q, k, v stacked: one GEMM
    assert hidden.shape == (3, 40, 64)
    return max((got - want).abs().max().item(), (fused - want).abs().max().item())


CASES = [
    ("llama", 2, False, None),  # GQA, untied
    ("llama", 4, True, None),  # MHA, tied
    ("llama", 1, False, LLAMA3_ROPE),  # MQA + llama3 rope scaling (positions beyond 16 matter)
    ("llama", 2, True, {"rope_type": "linear", "factor": 4.0}),
    ("qwen2", 2, False, None),  # QKV bias inferred from model_type
    ("qwen2", 2, True, None),
    ("qwen3", 2, False, None),  # per-head q/k norms before RoPE, head_dim given apart
    ("qwen3", 1, True, {"rope_type": "linear", "factor": 4.0}),
]


@pytest.mark.parametrize("kind,kv_heads,tied,rope", CASES)
def test_logits_match_transformers(tmp_path, kind, kv_heads, tied, rope):
    hf = _hf_model(kind, kv_heads=kv_heads, tied=tied, rope=rope)
    hf.save_pretrained(tmp_path)
    diff = _ours_vs_hf(hf, tmp_path)
    print(
        f"{kind} kv_heads={kv_heads} tied={tied} rope={rope and rope['rope_type']}: max abs diff {diff:.2e}"
    )
    assert diff <= TOL


def test_qwen2_bias_inferred_and_llama3_rope_parsed(tmp_path):
    hf = _hf_model("qwen2", kv_heads=2, tied=False)
    hf.save_pretrained(tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert "attention_bias" not in raw  # the reason it must be inferred
    assert read_config(tmp_path).attention_bias
    cfg = ModelConfig.from_hf_dict(
        {
            "model_type": "llama",
            "vocab_size": 10,
            "hidden_size": 8,
            "intermediate_size": 8,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "rope_theta": 5.0,
            "rope_scaling": LLAMA3_ROPE,
        }
    )
    assert (cfg.rope_scaling.kind, cfg.rope_theta, cfg.head_dim) == ("llama3", 5.0, 4)


def test_qwen2_config_saying_no_bias_loads_its_biases_as_transformers(tmp_path):
    """Hugging Face's and vLLM's Qwen2 build q/k/v with bias=True whatever attention_bias says;
    a Qwen2 config with attention_bias=false (a fine-tune's) was refused for its bias tensors."""
    hf = _hf_model("qwen2", kv_heads=2, tied=False)
    hf.save_pretrained(tmp_path)
    _edit(tmp_path, attention_bias=False)
    reloaded = transformers.Qwen2ForCausalLM.from_pretrained(tmp_path).eval()
    assert read_config(tmp_path).attention_bias
    assert _ours_vs_hf(reloaded, tmp_path) <= TOL


def test_sharded_checkpoint_loads(tmp_path):
    hf = _hf_model("llama", kv_heads=2, tied=False)
    hf.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    # a stale copy of a tensor in a shard the index does not name for it: the index's wins
    # (every shard was loaded whole, the last in sorted order winning)
    from safetensors.torch import load_file, save_file

    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted(set(weight_map.values()))
    name = next(n for n, shard in weight_map.items() if shard == shards[0])
    last = load_file(tmp_path / shards[-1])
    save_file({**last, name: torch.zeros_like(hf.state_dict()[name])}, tmp_path / shards[-1])
    assert _ours_vs_hf(hf, tmp_path) <= TOL


@pytest.mark.parametrize("kind,tied", [("llama", False), ("llama", True), ("qwen3", True)])
def test_save_hf_round_trips_through_transformers(tmp_path, kind, tied):
    hf = _hf_model(kind, kv_heads=2, tied=tied, rope=LLAMA3_ROPE if kind == "llama" else None)
    hf.save_pretrained(tmp_path / "a")
    ours = load_hf(tmp_path / "a")
    save_hf(ours, tmp_path / "b")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "b").eval()
    assert type(again).__name__ == type(hf).__name__
    diff = _ours_vs_hf(again, tmp_path / "a")
    assert diff <= TOL
    ids = torch.randint(0, 97, (1, 30))
    with torch.no_grad():
        assert torch.allclose(hf(input_ids=ids).logits, again(input_ids=ids).logits, atol=TOL)


def test_bad_checkpoints_give_one_line_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "vocab_size": 10}')
    with pytest.raises(CheckpointError, match="missing field 'num_attention_heads'"):
        load_hf(tmp_path)
    hf = _hf_model("llama", kv_heads=2, tied=False)
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"neither model.safetensors.*found$"):
        load_hf(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"pickle")  # an older hub checkpoint's weights
    with pytest.raises(CheckpointError, match=r"found \(pytorch_model.bin is not read: save"):
        load_hf(tmp_path)


def _llama_with(tmp_path, **config_fields):
    """A transformers Llama with extra config fields (bias layouts, activations), saved."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                   num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, **config_fields)  # fmt: skip
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    return tmp_path


def _edit(path, **fields):
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **fields}))


@pytest.mark.parametrize(
    "case",
    ["o_bias", "mlp_bias", "gelu", "quant_config", "int8", "float8",
     "rope_string"],
)  # fmt: skip
def test_layouts_tltrun_cannot_compute_are_refused_not_dropped(tmp_path, case):
    """Each of these loaded and computed other logits than transformers (a Llama o_proj bias
    or MLP biases dropped, GELU run as SiLU, int8 codes read as weights) or crashed: now one
    CheckpointError naming the field, from load_hf and from check_checkpoint alike."""
    from safetensors.torch import load_file, save_file

    from tltrun.model.hf_checkpoint import check_checkpoint

    if case == "o_bias":
        path, match = _llama_with(tmp_path, attention_bias=True), "attention_bias=true"
    elif case == "mlp_bias":
        path, match = _llama_with(tmp_path, mlp_bias=True), "mlp_bias"
    elif case == "gelu":
        path, match = _llama_with(tmp_path, hidden_act="gelu"), "hidden_act 'gelu'"
    elif case == "rope_string":
        path, match = _llama_with(tmp_path), "field 'rope_scaling': expected an object"
        _edit(path, rope_scaling="linear")
    elif case == "quant_config":
        path, match = _llama_with(tmp_path), "quantized checkpoint .quant_method 'fp8'"
        _edit(path, quantization_config={"quant_method": "fp8"})
    else:
        path = _llama_with(tmp_path)
        tensors = load_file(path / "model.safetensors")
        name = "model.layers.0.self_attn.q_proj.weight"
        dtype = torch.int8 if case == "int8" else torch.float8_e4m3fn
        tensors[name] = tensors[name].to(dtype)
        save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        match = f"{name}' has dtype (I8|int8|F8_E4M3|float8_e4m3fn): quantized"
    for load in (load_hf, check_checkpoint):
        with pytest.raises(CheckpointError, match=match):
            load(path)


def test_llama3_rope_without_context_lengths_uses_llamas_default():
    """transformers' LlamaConfig defaults max_position_embeddings to 2048, which llama3 RoPE
    then takes as its original context (tltrun took 8192)."""
    cfg = ModelConfig.from_hf_dict(
        {"model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 8,
         "num_hidden_layers": 1, "num_attention_heads": 2,
         "rope_scaling": {k: v for k, v in LLAMA3_ROPE.items()
                          if k != "original_max_position_embeddings"}}
    )  # fmt: skip
    assert cfg.rope_scaling.original_max_position_embeddings == 2048
    assert transformers.LlamaConfig().max_position_embeddings == 2048


BASE = {"vocab_size": 10, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 1,
        "num_attention_heads": 2}  # fmt: skip


def test_config_fields_read_as_transformers_reads_them_or_refused():
    """An odd head_dim loaded and crashed at the first forward (transformers refuses it); a
    Qwen2 config without max_position_embeddings got Llama's 2048 (Qwen2Config: 32768); a
    rope_scaling beside a rope_parameters saying otherwise was read one way, transformers the
    other (logits off by up to ~3)."""
    with pytest.raises(CheckpointError, match="head_dim must be even"):
        ModelConfig.from_hf_dict({"model_type": "llama", **BASE, "head_dim": 7})
    qwen = ModelConfig.from_hf_dict({"model_type": "qwen2", **BASE})
    assert qwen.max_position_embeddings == transformers.Qwen2Config().max_position_embeddings
    params = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    both = {"model_type": "llama", **BASE, "rope_parameters": params}
    with pytest.raises(CheckpointError, match="'rope_parameters' and 'rope_scaling' disagree"):
        ModelConfig.from_hf_dict({**both, "rope_scaling": {"type": "linear", "factor": 4.0}})
    same = ModelConfig.from_hf_dict(
        {**both, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}
    )
    assert (same.rope_theta, same.rope_scaling.factor) == (5e5, 2.0)  # saying the same: kept


def test_qwen3_configs_that_compute_another_layer_are_refused():
    """What a Qwen3 config may say that this layout does not compute: biases (Qwen3's
    attention_bias puts one on o_proj too), sliding-window layers (transformers 5's
    layer_types); its default context is Qwen3Config's."""
    qwen3 = ModelConfig.from_hf_dict({"model_type": "qwen3", **BASE})
    assert qwen3.has_qk_norm and not qwen3.attention_bias
    assert qwen3.max_position_embeddings == transformers.Qwen3Config().max_position_embeddings
    with pytest.raises(CheckpointError, match="a Qwen3 with attention_bias=true"):
        ModelConfig.from_hf_dict({"model_type": "qwen3", **BASE, "attention_bias": True})
    with pytest.raises(CheckpointError, match="qkv_bias=true is a Llama field"):
        ModelConfig.from_hf_dict({"model_type": "qwen3", **BASE, "qkv_bias": True})
    sliding = ["full_attention", "sliding_attention"]
    with pytest.raises(CheckpointError, match="layer_types .* not supported"):
        ModelConfig.from_hf_dict({"model_type": "qwen3", **BASE, "layer_types": sliding})
    full = ModelConfig.from_hf_dict({"model_type": "qwen2", **BASE, "layer_types": sliding[:1]})
    assert full.attention_bias and not full.has_qk_norm


def test_rope_frequencies_stay_float32_in_bfloat16():
    from tiny_models import tiny_config

    from tltrun.model.transformer import Transformer

    model = Transformer(tiny_config(rope_theta=500000.0)).to(torch.bfloat16)
    assert model.rotary.inv_freq.dtype == torch.float32
    cos, _ = model.rotary(torch.tensor([[100000]]), torch.bfloat16)
    exact = torch.cos(100000 * model.rotary.inv_freq.double())
    assert (
        cos[0, 0, : exact.numel()].double() - exact
    ).abs().max() < 1e-2  # bf16 output rounding only


def test_linear_weights_are_column_major_with_the_checkpoints_values(tmp_path):
    """gemm_layout: every Linear weight loads column-major (the fast CPU GEMM operand), with the
    checkpoint's names, shapes and values; an optimiser step and save_hf keep both."""
    hf = _hf_model("llama", kv_heads=2, tied=False)
    hf.save_pretrained(tmp_path / "a")
    ours = load_hf(tmp_path / "a")
    theirs = dict(hf.named_parameters())
    linears = [(n, m) for n, m in ours.named_modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 2 * 7 + 1  # q, k, v, o, gate, up, down per layer + lm_head
    for name, m in linears:
        w = m.weight
        assert w.stride() == (1, w.shape[0]) and not w.is_contiguous(), name
        assert torch.equal(w, theirs[f"{name}.weight"]), name
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3)
    ids = torch.randint(0, 97, (2, 12))
    logits, _ = ours(ids, torch.arange(12).expand(2, 12), CausalContext())
    logits.square().mean().backward()
    opt.step()
    w = ours.lm_head.weight
    assert w.grad.stride() == w.stride() and w.stride() == (1, w.shape[0])
    save_hf(ours, tmp_path / "b")
    again = load_hf(tmp_path / "b")
    for (name, p), q in zip(ours.named_parameters(), again.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert not torch.equal(ours.lm_head.weight, theirs["lm_head.weight"])  # the step moved it


def test_reduce_grads_goes_through_one_flat_tensor_and_keeps_layouts():
    from tltrun.model.transformer import reduce_grads

    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 4, bias=True)
    lin.weight.data = lin.weight.data.t().contiguous().t()  # column-major, as gemm_layout
    lin(torch.randn(3, 6)).sum().backward()
    lin.bias.grad = None  # a parameter without a gradient takes part as zeros
    before = lin.weight.grad.clone()
    seen = []

    def reduce(flat):
        seen.append(flat.numel())
        flat.mul_(2.0)

    reduce_grads([lin.weight, lin.bias], reduce)
    assert seen == [6 * 4 + 4]
    assert torch.equal(lin.weight.grad, 2 * before) and torch.equal(lin.bias.grad, torch.zeros(4))
    assert lin.weight.grad.stride() == lin.weight.stride() == (1, 4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_is_hugging_faces_rotate_half_formula_bit_for_bit(dtype):
    """``apply_rope`` with ``Rotary``'s signed sine gives exactly the products of Hugging
    Face's ``q * cos + rotate_half(q) * sin`` (its rotate_half: ``cat(-x2, x1)``)."""
    from tiny_models import tiny_config

    from tltrun.model.transformer import Rotary, apply_rope

    cfg = tiny_config(rope_theta=1e6)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 4096, (2, 5), generator=gen)
    x = torch.randn(2, 4, 5, cfg.head_dim, generator=gen).to(dtype)  # (B,H,T,D)
    freqs = positions[..., None].float() * Rotary(cfg).inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]
    half = cfg.head_dim // 2
    want = x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin
    got_cos, signed_sin = Rotary(cfg)(positions, dtype)
    assert torch.equal(got_cos[:, None], cos)
    assert torch.equal(apply_rope(x, got_cos[:, None], signed_sin[:, None]), want)


@pytest.mark.parametrize("device", ["cpu", cuda_param("its fused kernel")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_is_hugging_faces_order_bit_for_bit(device, dtype):
    """Hugging Face's Qwen2RMSNorm, ``weight * (x.float() * rsqrt(mean(x^2) + eps)).to(dtype)``,
    exactly on CPU; on CUDA (whose fused kernel reduces in its own order) the float32 norm
    rounded to ``dtype`` afterwards, the earlier form of this layer: exactly in float32; in
    bfloat16 within two bf16 ulps (the kernel's bf16 and fp32 instantiations load 8 and 4
    values a vector, so their sums of squares may differ in the last fp32 bit, which moves an
    element across a bf16 rounding boundary about once in 2^16: a review of the CUDA paths)."""
    from tltrun.model.transformer import RMSNorm

    gen = torch.Generator().manual_seed(1)
    x = (3 * torch.randn(4, 7, 896, generator=gen)).to(device, dtype)
    norm = RMSNorm(896, 1e-6).to(device)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(896, generator=gen))
    norm = norm.to(dtype)
    h = x.float()
    hf = norm.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(dtype)
    rounded_after = norm.weight * F.rms_norm(h, (896,), eps=1e-6).to(dtype)
    with torch.no_grad():
        got = norm(x)
    assert got.dtype == dtype
    is_cuda_bf16 = device != "cpu" and dtype == torch.bfloat16
    torch.testing.assert_close(got, rounded_after, atol=0, rtol=2**-6 if is_cuda_bf16 else 0)
    if device == "cpu":
        torch.testing.assert_close(got, hf, atol=0, rtol=0)

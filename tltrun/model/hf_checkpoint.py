"""Hugging Face checkpoints of ``tltrun.model.transformer.Transformer``: ``config.json`` +
``model.safetensors`` (or the shards a ``model.safetensors.index.json`` lists), loaded with every
tensor's name and shape checked against the config (on the meta device: a corrupted size is
reported, never allocated) and saved with a tied LM head stored once, as Hugging Face does.

    model = load_hf("./Qwen2.5-0.5B-Instruct", dtype=torch.bfloat16, device="cuda")
    save_hf(model, "out/actor")

A truncated, garbage or non-finite file is one ``CheckpointError`` naming it. Try it:
``python -m pytest tests/test_model.py tests/test_run_integrity.py -q``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from tltrun.model.config import CheckpointError, ModelConfig, check_device, read_config
from tltrun.model.transformer import Transformer
from tltsim.errors import UsageError
from tltsim.jsonio import read_json

# dtypes a checkpoint's tensors may have: what the model computes in, converted on load
WEIGHT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
HEADER_DTYPES = ("F32", "BF16", "F16", "F64")  # the same, as safetensors headers name them
# tensors older Hugging Face checkpoints store that the model recomputes (RoPE frequencies)
RECOMPUTED_SUFFIXES = ("rotary_emb.inv_freq",)


def load_safetensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of one safetensors file; a truncated or garbage file, or one holding NaN or
    inf, is one CheckpointError naming it (not a SafetensorError traceback, not a silent run)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    try:
        tensors = load_file(file)
    except (SafetensorError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({reason}); truncated or corrupted?"
        ) from None
    for name, tensor in tensors.items():
        if tensor.dtype not in WEIGHT_DTYPES:  # int8 codes, float8: quantized weights
            raise CheckpointError(_quantized(file, name, str(tensor.dtype).removeprefix("torch.")))
        if not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"{file}: tensor {name!r} holds NaN or inf values; corrupted?")
    return tensors


def check_dtype_range(source: str | Path, tensors: dict[str, torch.Tensor], dtype: torch.dtype):
    """Refuse weights that ``dtype`` cannot hold: a value beyond float16's 65,504 became inf in
    the cast after the load's finiteness check, and the engine then sampled token 0 every
    time without a word. bfloat16 has float32's range, so only float16 refuses in practice."""
    if not dtype.is_floating_point:
        return
    limit = torch.finfo(dtype).max
    for name, tensor in tensors.items():
        largest = float(tensor.abs().max()) if tensor.numel() else 0.0
        if largest > limit:
            raise CheckpointError(
                f"{source}: tensor {name!r} holds values up to {largest:.4g}, beyond "
                f"{str(dtype).removeprefix('torch.')}'s range ({limit:.5g}); load it in "
                "bfloat16 or float32"
            )


def read_safetensors(model_dir: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of ``model.safetensors`` or of the shards listed in the index file."""
    root = Path(model_dir)
    single, index = root / "model.safetensors", root / "model.safetensors.index.json"
    if single.is_file():
        return load_safetensors(single)
    if not index.is_file():
        raise _no_safetensors(root)
    try:
        weight_map = read_json(index, "safetensors index", CheckpointError)["weight_map"]
        shards = sorted(set(weight_map.values()))
    except (KeyError, TypeError, AttributeError):
        raise CheckpointError(f"{index}: expected JSON with a 'weight_map' field") from None
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        if not isinstance(shard, str) or not (root / shard).is_file():
            raise CheckpointError(f"{index}: shard {shard!r} listed but missing")
        loaded = load_safetensors(root / shard)
        # each tensor from the shard the index names (a stale copy in another shard, loaded
        # last, replaced it), as transformers loads them
        for name in (n for n, where in weight_map.items() if where == shard):
            if name not in loaded:
                raise CheckpointError(f"{index}: tensor {name!r} listed in {shard} but not in it")
            tensors[name] = loaded[name]
    return tensors


def safetensors_shapes(file: Path) -> dict[str, tuple[int, ...]]:
    """Tensor names and shapes from a safetensors header, reading no weights; a missing,
    truncated or garbage file is one CheckpointError naming it."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt") as f:
            shapes, dtypes = {}, {}
            for k in f.keys():  # noqa: SIM118
                shapes[k] = tuple(f.get_slice(k).get_shape())
                dtypes[k] = f.get_slice(k).get_dtype()
    except (SafetensorError, OSError) as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"{file}: not a readable safetensors file ({reason}); truncated or corrupted?"
        ) from None
    for name, dtype in dtypes.items():
        if dtype not in HEADER_DTYPES:
            raise CheckpointError(_quantized(file, name, dtype))
    return shapes


def _quantized(file: Path, name: str, dtype: str) -> str:
    return (
        f"{file}: tensor {name!r} has dtype {dtype}: quantized weights are not supported (use "
        "the bf16/fp16/fp32 checkpoint)"
    )


def _safetensors_files(root: Path) -> list[Path]:
    """``model.safetensors``, or the shards its index lists (sorted)."""
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        return [root / "model.safetensors"]
    if index.is_file():
        weight_map = read_json(index, "safetensors index", CheckpointError)
        if not isinstance(weight_map, dict) or not isinstance(weight_map.get("weight_map"), dict):
            raise CheckpointError(f"{index}: expected JSON with a 'weight_map' field")
        return [root / str(s) for s in sorted(set(map(str, weight_map["weight_map"].values())))]
    raise _no_safetensors(root)


def _no_safetensors(root: Path) -> CheckpointError:
    """The refusal of a directory without safetensors weights; PyTorch ``.bin`` weights (older
    hub checkpoints) are named: they are not read (pickles run code when loaded)."""
    bins = sorted(p.name for p in root.glob("pytorch_model*.bin"))
    hint = (
        f" ({bins[0]} is not read: save the model with safetensors, e.g. transformers' "
        "save_pretrained)"
        if bins
        else ""
    )
    return CheckpointError(
        f"{root}: neither model.safetensors nor model.safetensors.index.json found{hint}"
    )


# Files up to this size are hashed whole; larger ones (a 7B checkpoint is 15 GB: ~10 s of
# sha256) by their header and DIGEST_SAMPLES evenly spread 4 KiB blocks, which any training
# step changes (every weight moves, so every block holds changed values) at ~1 MB read a file.
DIGEST_WHOLE_BYTES = 1 << 30
DIGEST_SAMPLES = 256
DIGEST_BLOCK_BYTES = 4096


def checkpoint_digest(model_dir: str | Path) -> str:
    """sha256 over ``config.json`` and the weights' files: a cheap check that a directory
    still holds the checkpoint a resumable run started on (``tltrun train-drafter --resume``).
    Files over ``DIGEST_WHOLE_BYTES`` are sampled: a change confined to unsampled bytes of
    such a file (not what training or a different model does) passes unseen."""
    import hashlib

    root = Path(model_dir)
    digest = hashlib.sha256((root / "config.json").read_bytes())
    for file in _safetensors_files(root):
        size = file.stat().st_size
        digest.update(f"{file.name}:{size}".encode())
        with file.open("rb") as f:
            if size <= DIGEST_WHOLE_BYTES:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    digest.update(chunk)
                continue
            # safetensors: a u64 header length, the header (at most 100 MB by the format's rule)
            header_bytes = min(8 + int.from_bytes(f.read(8), "little"), 100 << 20, size)
            f.seek(0)
            digest.update(f.read(header_bytes))
            step = max(1, (size - header_bytes) // DIGEST_SAMPLES)
            for offset in range(header_bytes, size, step):
                f.seek(offset)
                digest.update(f.read(DIGEST_BLOCK_BYTES))
    return digest.hexdigest()


def check_checkpoint(model_dir: str | Path) -> ModelConfig:
    """Validate a model directory without loading its weights: config.json, and every
    safetensors file's header (a truncated or garbage file fails here) with the tensors' names
    and shapes against the config. ``tltrun train`` runs it before starting its workers, so a
    damaged checkpoint is one error line, not a traceback per worker."""
    root = Path(model_dir)
    cfg = read_config(root)
    files = _safetensors_files(root)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    found: dict[str, tuple[int, ...]] = {}
    for file in files:
        found.update(safetensors_shapes(file))
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
        found.pop("lm_head.weight", None)  # some tied checkpoints store a duplicate
    _check_known(root, cfg, found, shapes)
    for name, want in shapes.items():
        if name not in found:
            raise CheckpointError(f"{root}: missing tensor {name!r}")
        if found[name] != want:
            raise CheckpointError(
                f"{root}: tensor {name!r} has shape {found[name]}, config implies {want}"
            )
    return cfg


def _check_known(root: str | Path, cfg: ModelConfig, found: dict, shapes: dict) -> None:
    """A tensor the model has no place for is a layout it does not compute (biases its config
    does not declare, extra norms): refused, never dropped."""
    unknown = sorted(
        name for name in set(found) - set(shapes) if not name.endswith(RECOMPUTED_SUFFIXES)
    )
    if unknown:
        raise CheckpointError(
            f"{root}: tensor {unknown[0]!r} ({len(unknown)} in all) has no place in a "
            f"{cfg.model_type} model of this config.json (a layout tltrun does not compute)"
        )


def load_hf(
    model_dir: str | Path, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> Transformer:
    try:
        check_device(device)
    except ValueError as err:
        raise UsageError(str(err)) from None
    cfg = read_config(model_dir)
    tensors = read_safetensors(model_dir)
    # Shapes from a model on the meta device (no memory): a config whose sizes do not match
    # the weights (e.g. a corrupted vocab_size of 10^21) is reported, never allocated.
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Transformer(cfg).state_dict().items()}
    if cfg.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)  # some tied checkpoints store a duplicate
    expected = set(shapes) - cfg.tied_names
    missing = sorted(expected - set(tensors))
    if missing:
        raise CheckpointError(
            f"{model_dir}: missing tensor {missing[0]!r} ({len(missing)} missing in all)"
        )
    for name in expected:
        want = shapes[name]
        if tuple(tensors[name].shape) != want:
            raise CheckpointError(
                f"{model_dir}: tensor {name!r} has shape {tuple(tensors[name].shape)}, config implies {want}"
            )
    _check_known(model_dir, cfg, tensors, shapes)
    check_dtype_range(model_dir, {k: tensors[k] for k in expected}, dtype)
    model = Transformer(cfg)
    model.load_state_dict({k: tensors[k] for k in expected}, strict=False)
    return model.to(device=device, dtype=dtype).eval()


def save_hf(
    model: Transformer, model_dir: str | Path, state_dict: dict[str, torch.Tensor] | None = None
) -> None:
    """Write ``config.json`` + ``model.safetensors`` (tied LM head stored once, as HF does).
    ``state_dict``: the full weights when the model's own are sharded (FSDP2)."""
    root = Path(model_dir)
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(model.config.to_hf_dict(), indent=2) + "\n")
    weights = model.state_dict() if state_dict is None else state_dict
    state = {k: v.detach().contiguous().cpu() for k, v in weights.items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight")
    save_safetensors(state, root / "model.safetensors")


def save_safetensors(state: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors``' ``save_file`` with the permissions any new file of this process gets
    (safetensors 0.8 writes 0600 whatever the umask: a run directory shared with a group
    held every file readable but the weights)."""
    from safetensors.torch import save_file

    save_file(state, path, metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """This process's umask, read without changing it (Linux), else by setting it back."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask

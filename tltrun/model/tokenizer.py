"""A character-level tokenizer for the built-in task (tltrun.train.tasks), saved in the Hugging Face
layout so ``transformers.AutoTokenizer.from_pretrained(dir)`` and vLLM load it unchanged.

One token per character: printable ASCII (32..126) and newline, after four special tokens
``<pad>`` (0), ``<s>`` (1, BOS), ``</s>`` (2, EOS) and ``<unk>`` (3) — 100 tokens in all.
Characters outside the alphabet encode to ``<unk>``. ``CharTokenizer.encode`` prepends BOS by
default, exactly as the saved post-processor does for ``AutoTokenizer(text)``.

Files written by ``save(dir)``:

* ``tokenizer.json`` — built with the ``tokenizers`` library: a BPE model with no merges (so
  every character is its own token), a ``Fuse`` decoder (tokens concatenate, no spaces), and a
  ``<s> $A`` template post-processor;
* ``tokenizer_config.json`` — ``PreTrainedTokenizerFast`` with the special tokens and
  ``clean_up_tokenization_spaces: false`` (clean-up would delete spaces before punctuation and
  break the round trip);
* ``special_tokens_map.json``.

Encoding and decoding themselves are plain Python (no dependency at run time); the tests check
that AutoTokenizer gives the same ids. One known difference: the HF tokenizer also matches the
literal strings ``<s>``, ``</s>``, ... inside text as special tokens; this one never does.

``tltrun sft`` saves these files beside its checkpoint; ``CharTokenizer().save(dir)`` writes them
anywhere else.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable
from pathlib import Path

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
SPECIAL_TOKENS = (PAD, BOS, EOS, UNK)
DEFAULT_CHARS = "".join(chr(c) for c in range(32, 127)) + "\n"


class CharTokenizer:
    """Maps each character to one id; ids 0..3 are the special tokens."""

    pad_id = 0
    bos_id = 1
    eos_id = 2
    unk_id = 3

    def __init__(self, chars: str = DEFAULT_CHARS) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("CharTokenizer: duplicate characters in the alphabet")
        self.chars = chars
        self.tokens: tuple[str, ...] = SPECIAL_TOKENS + tuple(chars)
        self.vocab: dict[str, int] = {tok: i for i, tok in enumerate(self.tokens)}
        self._char_ids = {ch: len(SPECIAL_TOKENS) + i for i, ch in enumerate(chars)}

    @property
    def vocab_size(self) -> int:
        return len(self.tokens)

    def encode(self, text: str, add_bos: bool = True, add_eos: bool = False) -> list[int]:
        ids = [self._char_ids.get(ch, self.unk_id) for ch in text]
        return ([self.bos_id] if add_bos else []) + ids + ([self.eos_id] if add_eos else [])

    def decode(self, ids: Iterable[int], skip_special: bool = True) -> str:
        """Characters of ``ids`` concatenated; special tokens dropped unless ``skip_special`` is
        False. Raises ValueError on an id outside the vocabulary."""
        out = []
        for i in ids:
            if not 0 <= i < len(self.tokens):
                raise ValueError(f"token id {i} outside the vocabulary (size {len(self.tokens)})")
            if i < len(SPECIAL_TOKENS) and skip_special:
                continue
            out.append(self.tokens[i])
        return "".join(out)

    # ---- Hugging Face layout -----------------------------------------------------------

    def to_hf_json(self) -> str:
        """The ``tokenizer.json`` text, built by the ``tokenizers`` library."""
        from tokenizers import Tokenizer, decoders, models, processors

        tok = Tokenizer(models.BPE(vocab=dict(self.vocab), merges=[], unk_token=UNK))
        tok.add_special_tokens(list(SPECIAL_TOKENS))
        tok.decoder = decoders.Fuse()
        tok.post_processor = processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, self.bos_id)]
        )
        return tok.to_str(pretty=True)

    def save(self, directory: str | Path, model_max_length: int | None = None) -> None:
        """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        (out / "tokenizer.json").write_text(self.to_hf_json() + "\n")
        special = {"bos_token": BOS, "eos_token": EOS, "pad_token": PAD, "unk_token": UNK}
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **special,
            "clean_up_tokenization_spaces": False,
            "padding_side": "left",  # batched generation pads prompts on the left
        }
        if model_max_length is not None:
            config["model_max_length"] = model_max_length
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")

    @classmethod
    def load(cls, directory: str | Path) -> CharTokenizer:
        """Read a tokenizer written by ``save``; raises ValueError naming the file if it is
        not a character tokenizer with this layout."""
        path = Path(directory) / "tokenizer.json"
        try:
            vocab = json.loads(path.read_text())["model"]["vocab"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise ValueError(f"{path}: not a readable tokenizer.json ({err})") from None
        ordered = sorted(vocab.items(), key=lambda kv: kv[1])
        if [i for _, i in ordered] != list(range(len(ordered))):
            raise ValueError(f"{path}: token ids must be 0..{len(ordered) - 1} without gaps")
        tokens = [t for t, _ in ordered]
        if tuple(tokens[: len(SPECIAL_TOKENS)]) != SPECIAL_TOKENS:
            raise ValueError(f"{path}: the first ids must be {SPECIAL_TOKENS}, got {tokens[:4]}")
        chars = tokens[len(SPECIAL_TOKENS) :]
        if any(len(ch) != 1 for ch in chars):
            raise ValueError(f"{path}: not a character tokenizer (multi-character tokens)")
        return cls("".join(chars))


class UnknownCharsWarning(UserWarning):
    """Text characters outside the character tokenizer's alphabet (encoded as <unk>)."""


def warn_unknown_chars(source: str, texts: list[str]) -> None:
    """One warning for every character of ``texts`` (rows of ``source``) that encodes as
    <unk>: such a text decodes to another string (a response then never matches exactly)."""
    known = set(DEFAULT_CHARS)
    unknown = [ch for text in texts for ch in text if ch not in known]
    if unknown:
        rows = sum(any(ch not in known for ch in text) for text in texts)
        shown = "".join(sorted(set(unknown))[:10])
        warnings.warn(
            f"{source}: {rows} of {len(texts)} rows hold {len(unknown)} characters outside "
            f"the character tokenizer's alphabet ({shown!r}), trained as <unk>",
            UnknownCharsWarning,
            stacklevel=3,
        )

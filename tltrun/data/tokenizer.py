"""The tokenizer of a model directory, as ``tltrun train`` and ``tltrun sft`` use it: Hugging Face
files read with ``transformers.AutoTokenizer`` from local files only (no hub, no network), the
model's chat template applied to chat-message prompts, and the stop/pad ids gathered from the
tokenizer, ``config.json`` and ``generation_config.json``.

    tok = load_tokenizer("Qwen2.5-0.5B-Instruct")
    ids = tok.encode_prompt([{"role": "user", "content": "What is 3/4 as a decimal?"}])
    text = tok.decode(response_ids)

Prompts:

* a list of chat messages (``{"role": ..., "content": ...}``) always goes through the model's
  chat template with the generation prompt appended (``add_generation_prompt=True``), the way
  veRL and TRL build RL prompts from chat datasets; a list ending in an assistant message is
  a start of the response (an R1-style ``"<think>\n"``): that message is continued
  (``continue_final_message=True``, as TRL's ``apply_chat_template`` does), not closed and
  followed by a new assistant turn; a model without a template is an error;
* a plain string is encoded as it is (with the tokenizer's own special tokens, e.g. the BOS the
  built-in task's character tokenizer prepends), or wrapped as one user message and templated
  when ``is_chat_template`` is on (``--chat-template``).

Stop ids are the union of ``generation_config.json``'s ``eos_token_id`` (Qwen2.5-Instruct lists
both ``<|im_end|>`` and ``<|endoftext|>`` there), ``config.json``'s and the tokenizer's EOS:
generation stops at any of them, as ``transformers.generate`` and vLLM do. The pad id is the
tokenizer's pad token, else its EOS (padding is masked out; its value never matters).

The built-in task's character tokenizer (``tltrun.model.tokenizer.CharTokenizer``) is saved in
the same layout and loads through here too; AutoTokenizer gives the same ids (its tests).
"""

from __future__ import annotations

import functools
import json
import shutil
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tltrun.data.scoring import THINK_CLOSE, THINK_OPEN
from tltsim.errors import UsageError

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Every file a model directory's tokenizer may consist of, copied beside saved weights
# (transformers 5 keeps the chat template in chat_template.jinja; byte-level BPEs may ship
# vocab.json + merges.txt; generation_config.json holds the stop ids; sft_config.json tells
# ``tltrun sft-eval`` how the checkpoint was made).
TOKENIZER_COPY_FILES = (
    *TOKENIZER_FILES,
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
    "sft_config.json",
)

Prompt = str | Sequence[dict[str, str]]


class TokenizerError(UsageError):
    """A model directory whose tokenizer cannot be used; one line naming the file."""


class ChatTemplateError(TokenizerError):
    """The chat template refused one prompt (its ``raise_exception``, e.g. a Gemma or Mistral
    template given a system message or roles that do not alternate): a bad row of the data,
    which ``--skip-bad-rows`` may skip; a template that cannot run at all is a TokenizerError."""


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """What the runtime needs besides encode/decode, in one place (logged into config.json)."""

    vocab_size: int
    pad_id: int
    eos_ids: tuple[int, ...]
    has_chat_template: bool


class TextTokenizer:
    """A Hugging Face tokenizer with the prompt rules above. Not constructed directly: use
    ``load_tokenizer``."""

    def __init__(self, hf: Any, eos_ids: tuple[int, ...], is_chat_template: bool, source: str):
        self.hf = hf
        self.source = source
        self.eos_ids = eos_ids
        self.is_chat_template = is_chat_template
        pad = hf.pad_token_id if hf.pad_token_id is not None else eos_ids[0]
        self.pad_id = int(pad)

    @property
    def info(self) -> TokenizerInfo:
        return TokenizerInfo(
            vocab_size=len(self.hf),
            pad_id=self.pad_id,
            eos_ids=self.eos_ids,
            has_chat_template=bool(getattr(self.hf, "chat_template", None)),
        )

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def prompt_text(self, prompt: Prompt) -> str:
        """The prompt as the model sees it (after the chat template, if one applies)."""
        if isinstance(prompt, str) and not self.is_chat_template:
            return prompt
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        if not getattr(self.hf, "chat_template", None):
            raise TokenizerError(
                f"{self.source}/tokenizer_config.json: no 'chat_template', needed for chat-message "
                "prompts and --chat-template (use plain-text prompts, or a model with a template)"
            )
        import jinja2

        # the response continues a final assistant message (the module docstring)
        is_continued = messages[-1]["role"] == "assistant"
        try:
            return self.hf.apply_chat_template(
                [dict(m) for m in messages],
                tokenize=False,
                add_generation_prompt=not is_continued,
                continue_final_message=is_continued,
            )
        except jinja2.TemplateSyntaxError as err:
            raise TokenizerError(
                f"{self.source}: the chat template is not valid Jinja (line {err.lineno}: "
                f"{err.message})"
            ) from None
        except jinja2.TemplateError as err:
            raise ChatTemplateError(
                f"the model's chat template refused the prompt: {err}"
            ) from None
        except ValueError as err:  # transformers: a continued message the template dropped
            # (templates that strip an assistant turn's <think> part, e.g.), or another refusal
            what = "cannot continue the final assistant message" if is_continued else "refused"
            raise ChatTemplateError(f"the model's chat template {what}: {err}") from None

    def encode_prompt(self, prompt: Prompt) -> list[int]:
        """Token ids of a prompt: a templated prompt carries its own special tokens, a plain one
        gets the tokenizer's (BOS for the character tokenizer)."""
        text = self.prompt_text(prompt)
        is_templated = not (isinstance(prompt, str) and not self.is_chat_template)
        return list(self.hf(text, add_special_tokens=not is_templated)["input_ids"])

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: Sequence[int]) -> str:
        """Response text without special tokens (what rewards read), the thinking tags kept:
        a tokenizer that marks ``<think>``/``</think>`` special (Qwen3's does not) lost them
        with skip_special_tokens, and every answer after the thinking scored 0 (no
        ``</think>`` to find: ``scoring.final_part``)."""
        skipped = self._skipped_ids
        return self.hf.decode([i for i in ids if i not in skipped], skip_special_tokens=False)

    @functools.cached_property
    def _skipped_ids(self) -> frozenset[int]:
        """What skip_special_tokens drops (the special-tokens map and every added token marked
        special), less the thinking tags."""
        added = getattr(self.hf, "added_tokens_decoder", {})
        special = {*self.hf.all_special_ids, *(i for i, tok in added.items() if tok.special)}
        tags = {i for i, tok in added.items() if str(tok.content) in (THINK_OPEN, THINK_CLOSE)}
        return frozenset(special - tags)


def _eos_from_json(path: Path) -> list[int]:
    if not path.is_file():
        return []
    try:
        value = json.loads(path.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as err:
        raise TokenizerError(f"{path}: not readable JSON ({err})") from None
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
        raise TokenizerError(f"{path}: field 'eos_token_id' must be an id or a list of ids")
    return list(values)


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """The stop ids of ``model_dir/generation_config.json`` (none without the file): what
    transformers' ``generate()`` stops at beside config.json's EOS."""
    return tuple(_eos_from_json(Path(model_dir) / "generation_config.json"))


def load_tokenizer(model_dir: str | Path, *, is_chat_template: bool = False) -> TextTokenizer:
    """The tokenizer saved in ``model_dir`` (``tokenizer.json`` + ``tokenizer_config.json``)."""
    directory = Path(model_dir)
    for name in TOKENIZER_FILES:
        if not (directory / name).is_file():
            raise TokenizerError(
                f"{directory}: missing {name} (a model directory needs the Hugging Face "
                "tokenizer files tokenizer.json and tokenizer_config.json beside config.json)"
            )
    try:
        from transformers import AutoTokenizer
    except ImportError:
        raise UsageError(
            "loading a model's tokenizer needs transformers (pip install -e '.[run]')"
        ) from None
    try:
        hf = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types for a broken file
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TokenizerError(f"{directory}/tokenizer.json: cannot be loaded ({first})") from None
    eos: list[int] = []
    for source in (
        _eos_from_json(directory / "generation_config.json"),
        _eos_from_json(directory / "config.json"),
        [hf.eos_token_id] if hf.eos_token_id is not None else [],
    ):
        eos.extend(i for i in source if i not in eos)
    if not eos:
        raise TokenizerError(
            f"{directory}: no EOS id in generation_config.json, config.json or the tokenizer "
            "(responses could never stop before the token cap)"
        )
    return TextTokenizer(hf, tuple(eos), is_chat_template, str(directory))


def tokenizer_digest(model_dir: str | Path) -> str:
    """sha256 over the tokenizer files of ``model_dir`` (``TOKENIZER_COPY_FILES`` but
    ``sft_config.json``), each named: what a resume reloads the prompts' tokens, the chat
    template and the stop ids from (``checkpoint_digest`` covers the weights only)."""
    import hashlib

    digest = hashlib.sha256()
    for name in TOKENIZER_COPY_FILES:
        path = Path(model_dir) / name
        if name != "sft_config.json" and path.is_file():
            digest.update(f"{name}:{path.stat().st_size}:".encode() + path.read_bytes())
    return digest.hexdigest()


def copy_tokenizer(model_dir: str | Path, dest: Path) -> None:
    """Copy the tokenizer files of ``model_dir`` (those of ``TOKENIZER_COPY_FILES`` it has) into
    ``dest``, so a directory of saved weights loads with its tokenizer."""
    for name in TOKENIZER_COPY_FILES:
        src = Path(model_dir) / name
        if src.is_file():
            shutil.copyfile(src, dest / name)

"""Prompt formats and stop sets of a policy: raw templates, chat templates, and the ids that end a completion.

A policy's prompt is either a plain ``prompt_template`` (``"Q: {prompt}\\nA:"``; a BOS is prepended when the
tokenizer has one) or, with ``prompt_format: chat``, the checkpoint's own ``chat_template`` (from
``tokenizer_config.json``, or ``chat_template.jinja`` next to it) rendered by ``transformers``
(``PreTrainedTokenizerFast.apply_chat_template``; no Jinja of our own) as one user turn (after an optional
system turn) with the generation prompt appended. A chat prompt is encoded as the template wrote it: its
special-token spellings become control tokens and no BOS is added (the template writes ``bos_token`` itself
when the model wants one), exactly as ``apply_chat_template(tokenize=True)`` does.

    fmt = PromptFormat.chat_from(folder, system_prompt="Be brief.")   # or PromptFormat("Q: {prompt}\\nA:")
    ids = fmt.encode(tokenizer, ["What is 2+3?"])                     # list[list[int]]

``template_kwargs`` go to the template as TRL's ``chat_template_kwargs`` do (e.g. Qwen3's
``enable_thinking: false``).

``stop_ids(tokenizer, folder, extra, chat=...)`` is the policy's stop set: the tokenizer's EOS, every id of
``generation_config.json``'s ``eos_token_id`` (an int or a list: Llama-3 ``<|eot_id|>``, Qwen ``<|im_end|>``,
Phi-3 ``<|end|>``), for a chat policy the turn-end tokens of the known families that its tokenizer has
(``TURN_END_TOKENS``: a chat turn ends there whatever ``generation_config.json`` says), and the config's
``stop_tokens``; the sampler ends a row on any of them.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Sequence

from mrl_jax.tokenization import Tokenizer

__all__ = ["ChatDependencyError", "ChatTemplateError", "PromptFormat", "TURN_END_TOKENS", "as_prompt_format",
           "read_chat_template", "stop_ids", "tokenizer_folder"]

# the token ending an assistant turn: ChatML (Qwen), Gemma, Phi-3 / Phi-4, Llama 3
TURN_END_TOKENS = ("<|im_end|>", "<end_of_turn>", "<|end|>", "<|eot_id|>")

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")


class ChatTemplateError(ValueError):
    """A chat format was asked of a tokenizer folder that has no chat template (message names file and key)."""


class ChatDependencyError(ValueError):
    """Rendering a chat template needs a package that is not installed (jinja2): the template is not at fault."""


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON ({e}); fix or remove the file") from e


def tokenizer_folder(tokenizer: Tokenizer) -> Path | None:
    """The directory the tokenizer was loaded from: the parent of its ``tokenizer.json`` (or of a file with a
    ``tokenizer_config.json`` beside it); None for a locally trained one (its source is a cache file)."""
    if not tokenizer.source:
        return None
    src = Path(tokenizer.source)
    return src.parent if src.name == "tokenizer.json" or (src.parent / "tokenizer_config.json").is_file() else None


def read_chat_template(folder: str | Path) -> str:
    """The ``chat_template`` of ``folder/tokenizer_config.json`` (a string, or the ``default`` entry of a list
    of named templates), else ``folder/chat_template.jinja``; raises ``ChatTemplateError`` naming both."""
    folder = Path(folder)
    conf = _read_json(folder / "tokenizer_config.json")
    tpl = conf.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if not tpl and (folder / "chat_template.jinja").is_file():
        tpl = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if not isinstance(tpl, str) or not tpl.strip():
        raise ChatTemplateError(
            f"{folder / 'tokenizer_config.json'} has no 'chat_template' key (and {folder} has no chat_template.jinja); "
            "add the model's chat template there, or use prompt_format: template with a prompt_template")
    return tpl


class _ChatRenderer:
    """``render(texts) -> list[str]`` through transformers' ``apply_chat_template`` (built on first use)."""

    def __init__(self, folder: Path, template: str, system_prompt: str | None, template_kwargs: dict):
        self.folder, self.template, self.system_prompt = folder, template, system_prompt
        self.template_kwargs = dict(template_kwargs)
        self._hf = None

    def _tokenizer(self):
        if self._hf is None:
            from transformers import PreTrainedTokenizerFast

            conf = _read_json(self.folder / "tokenizer_config.json")
            specials = {}
            for k in _SPECIAL_KEYS:
                v = conf.get(k)
                v = v.get("content") if isinstance(v, dict) else v
                if isinstance(v, str):
                    specials[k] = v
            self._hf = PreTrainedTokenizerFast(tokenizer_file=str(self.folder / "tokenizer.json"),
                                               chat_template=self.template, **specials)
        return self._hf

    def messages(self, text: str) -> list[dict]:
        turns = [{"role": "system", "content": self.system_prompt}] if self.system_prompt is not None else []
        return turns + [{"role": "user", "content": text}]

    def end_of_turn(self) -> str | None:
        """The special token the template writes right after an assistant turn's text (Phi-3 ``<|end|>``,
        ChatML ``<|im_end|>``), or None (no such token, or the template renders no assistant turn)."""
        hf, mark = self._tokenizer(), "\u2063mrl\u2063"
        try:
            text = self._apply(hf, self.messages("x") + [{"role": "assistant", "content": mark}])
        except ChatDependencyError:
            raise
        except Exception:  # noqa: BLE001 -- a template that refuses this conversation names no end-of-turn
            return None
        tail = text.split(mark, 1)[1] if mark in text else ""
        specials = [t.content for t in hf.added_tokens_decoder.values() if t.special]
        return next((t for t in sorted(specials, key=len, reverse=True) if tail.startswith(t)), None)

    def _apply(self, hf, messages: list[dict], **kwargs) -> str:
        """``apply_chat_template`` as text; ChatDependencyError when transformers cannot render (no jinja2)."""
        try:
            return hf.apply_chat_template(messages, tokenize=False, **kwargs)
        except ImportError as e:
            raise ChatDependencyError(
                f"{self.folder / 'tokenizer_config.json'}: prompt_format: chat renders the chat template with jinja2, "
                f"which is missing ({type(e).__name__}: {e}); pip install 'jinja2>=3.1.6' (an mrl-jax dependency: "
                "pip install -e . installs it)") from None

    def render(self, texts: Sequence[str]) -> list[str]:
        hf = self._tokenizer()
        try:
            return [self._apply(hf, self.messages(t), add_generation_prompt=True, **self.template_kwargs)
                    for t in texts]
        except ChatDependencyError:
            raise
        except Exception as e:  # jinja2 raises TemplateError subclasses (e.g. "System role not supported")
            raise ValueError(f"{self.folder / 'tokenizer_config.json'}: rendering its 'chat_template' failed "
                             f"({type(e).__name__}: {e}); drop system_prompt or fix the template") from e


@dataclasses.dataclass(frozen=True, eq=False)
class PromptFormat:
    """How a policy turns a prompt text into ids: ``template`` (``{prompt}`` substituted, BOS prepended when
    the tokenizer has one) or a chat template (``chat`` set; template ignored; no BOS added)."""

    template: str = "{prompt}"
    chat: _ChatRenderer | None = None

    @classmethod
    def chat_from(cls, folder: str | Path, system_prompt: str | None = None,
                  template_kwargs: dict | None = None) -> "PromptFormat":
        """The chat template of ``folder``; ``template_kwargs``: extra template variables (TRL's
        ``chat_template_kwargs``, e.g. ``{"enable_thinking": False}`` for Qwen3)."""
        folder = Path(folder)
        return cls(chat=_ChatRenderer(folder, read_chat_template(folder), system_prompt, template_kwargs or {}))

    @property
    def is_chat(self) -> bool:
        return self.chat is not None

    def render(self, texts: Sequence[str]) -> list[str]:
        """Prompt strings as the model sees them (before tokenization)."""
        if self.chat is not None:
            return self.chat.render(texts)
        return [self.template.format(prompt=t) for t in texts]

    def encode(self, tokenizer: Tokenizer, texts: Sequence[str]) -> list[list[int]]:
        """Prompt ids (unpadded): ``render`` then tokenize; BOS first for a template when the tokenizer has one."""
        seqs = tokenizer.encode_batch(self.render(texts))
        if self.chat is None and tokenizer.bos_id is not None:
            seqs = [[tokenizer.bos_id] + s for s in seqs]
        return seqs


def as_prompt_format(fmt: "str | PromptFormat") -> PromptFormat:
    return fmt if isinstance(fmt, PromptFormat) else PromptFormat(template=fmt)


def _ids(value) -> list[int]:
    if value is None or isinstance(value, bool):
        return []
    if isinstance(value, int):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


def stop_ids(tokenizer: Tokenizer, folder: str | Path | None = None,
             extra: Sequence[int | str] = (), *, chat: bool = False) -> tuple[int, ...]:
    """The stop set, in order, without repeats: tokenizer EOS, ``folder/generation_config.json``'s
    ``eos_token_id`` (int or list), with ``chat`` the ``TURN_END_TOKENS`` the tokenizer has, then ``extra``
    (token spellings or ids). Raises ``ValueError`` naming an ``extra`` entry that is not a token of
    ``tokenizer``."""
    out: list[int] = []
    if tokenizer.eos_id is not None:
        out.append(int(tokenizer.eos_id))
    if folder is not None:
        gen = _read_json(Path(folder) / "generation_config.json")
        out += [i for i in _ids(gen.get("eos_token_id")) if 0 <= i < tokenizer.vocab_size]
    if chat:
        out += [i for i in map(tokenizer.token_to_id, TURN_END_TOKENS) if i is not None]
    for t in extra:
        i = t if isinstance(t, int) else tokenizer.token_to_id(t)
        if i is None or not 0 <= int(i) < tokenizer.vocab_size:
            raise ValueError(f"stop token {t!r} is not in the tokenizer (vocabulary of {tokenizer.vocab_size}); "
                             "give a token spelling from its tokenizer.json (e.g. '<|im_end|>') or an id")
        out.append(int(i))
    return tuple(dict.fromkeys(out))

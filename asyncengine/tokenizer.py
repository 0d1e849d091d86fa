"""Tokenizer loading, chat templates, incremental detokenization and stop-string matching.

Incremental detokenization does constant work per token: it decodes only a short window of recent tokens
(`prefix_offset:`) and subtracts the text of the window's already-emitted part (`prefix_offset:read_offset`).
If the window's text ends in U+FFFD, a multi-byte UTF-8 character is split across tokens and the text is held
back until the next token completes it.

Byte-level BPE tokenizers (GPT-2, Llama-3, Qwen, the default model) take a faster path: every token id maps to a
fixed byte string, so a token costs one table lookup and one step of an incremental UTF-8 decoder, which holds
incomplete characters back by itself. Stop strings are searched for only in the tail of the text that a new
piece could have completed, so a stop string split across tokens is still found.
"""

from __future__ import annotations

import codecs
import json
from typing import Any, Optional

from asyncengine.sampling_params import SamplingParams

_WINDOW = 6  # tokens of context kept before the read offset; enough for any merge-sensitive decoder


_JINJA_MARKS = "{}\n"  # a --chat-template value holding any of these is a template, not a path (as in vLLM)


def load_tokenizer(path: str):
    """The folder's tokenizer. Its `model_max_length` is lifted: the engine enforces max_model_len itself (a
    ValueError / 400 stating the numbers), and the tokenizer's own limit would only make transformers also
    warn of "indexing errors" for every prompt longer than it, rejected or not."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER

    try:
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types here; name the folder and the cause
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc
    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer


def resolve_chat_template(value: str) -> str:
    """The chat template that `--chat-template value` names: the file's text if `value` is a file, else `value`
    itself if it looks like a Jinja template (holds a brace or a newline). ValueError for anything else (a
    mistyped path) and for a template that does not parse."""
    from pathlib import Path

    import jinja2

    if Path(value).is_file():
        template = Path(value).read_text()
    elif any(mark in value for mark in _JINJA_MARKS):
        template = value
    else:
        raise ValueError(f"chat_template {value!r} is neither a file nor a Jinja template")
    try:
        jinja2.Environment().parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ValueError(f"chat_template does not parse: {exc}") from None
    return template


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
    """Render messages with `kwargs["chat_template"]` if given, else the checkpoint's chat template (ValueError
    if there is none or the messages are bad)."""
    if not kwargs.get("chat_template") and not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template; use completions instead of chat")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message:
            raise ValueError(f"messages[{i}] must be an object with a 'role'")
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **kwargs
        )
    except Exception as exc:  # jinja errors: report them as bad input
        raise ValueError(f"chat template failed on these messages: {exc}") from exc


def _byte_decoder() -> dict[str, int]:
    """The inverse of byte-level BPE's byte -> printable character map (bytes 0-255 made visible)."""
    visible = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    chars, extra = {}, 0
    for b in range(256):
        if b in visible:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars


ByteTable = tuple[list[Optional[bytes]], set[int], set[int]]  # (bytes per id, added ids, special ids)


def byte_level_table(tokenizer) -> Optional[ByteTable]:
    """(bytes of every token id, ids of added tokens, ids of special tokens) for a byte-level BPE tokenizer;
    None for any other kind.

    Built once per tokenizer and cached on it. Added tokens map to their literal text."""
    cached = getattr(tokenizer, "_asyncengine_byte_table", False)
    if cached is not False:
        return cached
    table = None
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        if (spec.get("decoder") or {}).get("type") == "ByteLevel" and not spec.get("normalizer"):
            table = _build_byte_table(tokenizer)
    tokenizer._asyncengine_byte_table = table
    return table


def _build_byte_table(tokenizer) -> Optional[ByteTable]:
    decoder = _byte_decoder()
    added = {i: t for i, t in tokenizer.added_tokens_decoder.items()}
    size = max(len(tokenizer), max(added, default=0) + 1)
    pieces: list[Optional[bytes]] = []
    for token_id, token in enumerate(tokenizer.convert_ids_to_tokens(list(range(size)))):
        if token_id in added:
            pieces.append(added[token_id].content.encode())
        elif token is None:
            pieces.append(None)
        elif all(c in decoder for c in token):
            pieces.append(bytes(decoder[c] for c in token))
        else:
            return None  # not a pure byte-level vocabulary: use the generic path
    special = {i for i, t in added.items() if t.special}
    return pieces, set(added), special


class IncrementalDetokenizer:
    """Turns a growing token list into text deltas; finds stop strings. One per generated sequence."""

    def __init__(self, tokenizer, prompt_len: int, params: SamplingParams):
        self.tokenizer = tokenizer
        self.prefix_offset = max(prompt_len - _WINDOW, 0)
        self.read_offset = prompt_len
        self.skip_special_tokens = params.skip_special_tokens
        self.stop = params.stop
        self.include_stop = params.include_stop_str_in_output
        self.max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self._table = byte_level_table(tokenizer)
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # A fast tokenizer's decode without clean-up is its Rust backend's decode; calling that directly skips
        # ~10 us of Python argument handling per call (two calls per token on the generic path).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def update(self, token_ids: list[int], final: bool = False) -> Optional[str]:
        """Account for token_ids[-1] (token_ids = prompt + output so far). Returns the stop string matched, if
        any; the text is then cut at it (or just after it with include_stop_str_in_output)."""
        new_text = self._update_bytes(token_ids, final) if self._table is not None else self._update_window(token_ids, final)
        if not new_text:
            return None
        start = len(self.text)
        self.text += new_text
        return self._find_stop(start)

    def _update_bytes(self, token_ids: list[int], final: bool) -> str:
        """Byte-level path: the new tokens' bytes through the incremental UTF-8 decoder. Added tokens are
        literal text decoded on their own (as transformers does), so pending bytes are flushed before them."""
        pieces, added, special = self._table
        out = []
        for token_id in token_ids[self.read_offset :]:
            piece = pieces[token_id] if token_id < len(pieces) else None
            if piece is None or (token_id in special and self.skip_special_tokens):
                continue
            if token_id in added:
                out.append(self._utf8.decode(b"", final=True) + piece.decode())
            else:
                out.append(self._utf8.decode(piece))
        if final:
            out.append(self._utf8.decode(b"", final=True))
        self.read_offset = len(token_ids)
        return "".join(out)

    def _update_window(self, token_ids: list[int], final: bool) -> str:
        """Generic path: decode a short window and subtract the part already emitted."""
        window = token_ids[self.prefix_offset :]
        before = self._decode(token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(window)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return ""  # nothing new yet, or a character still split across tokens
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        return after[len(before) :]

    def _find_stop(self, new_start: int) -> Optional[str]:
        if not self.stop:
            return None
        search_from = max(new_start - self.max_stop_len + 1, 0)
        best: Optional[tuple[int, str]] = None
        for stop in self.stop:
            at = self.text.find(stop, search_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop

    def visible_len(self, finished: bool) -> int:
        """How much of the text may be streamed: while running, hold back a tail that could still turn out to
        be the start of a stop string (it would be cut)."""
        if finished or not self.stop or self.include_stop:
            return len(self.text)
        return max(len(self.text) - (self.max_stop_len - 1), 0)

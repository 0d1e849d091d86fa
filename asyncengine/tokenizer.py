"""Tokenizer loading, chat templates, incremental detokenization and stop-string matching.

Incremental detokenization does constant work per token: it decodes only a short window of recent tokens
(`prefix_offset:`) and subtracts the text of the window's already-emitted part (`prefix_offset:read_offset`).
If the window's text ends in U+FFFD, a multi-byte UTF-8 character is split across tokens and the text is held
back until the next token completes it. Stop strings are searched for only in the tail of the text that a new
piece could have completed, so a stop string split across tokens is still found.
"""

from __future__ import annotations

from typing import Any, Optional

from asyncengine.sampling_params import SamplingParams

_WINDOW = 6  # tokens of context kept before the read offset; enough for any merge-sensitive decoder


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises many types here; name the folder and the cause
        raise ValueError(f"cannot load a tokenizer from {path}: {exc}") from exc


def apply_chat_template(tokenizer, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs) -> str:
    """Render messages with the checkpoint's chat template (ValueError if it has none or messages are bad)."""
    if not getattr(tokenizer, "chat_template", None):
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

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(
            ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
        )

    def update(self, token_ids: list[int], final: bool = False) -> Optional[str]:
        """Account for token_ids[-1] (token_ids = prompt + output so far). Returns the stop string matched, if
        any; the text is then cut at it (or just after it with include_stop_str_in_output)."""
        window = token_ids[self.prefix_offset :]
        before = self._decode(token_ids[self.prefix_offset : self.read_offset])
        after = self._decode(window)
        if len(after) <= len(before) or (after.endswith("\ufffd") and not final):
            return None  # nothing new yet, or a character still split across tokens
        new_text = after[len(before) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(token_ids)
        start = len(self.text)
        self.text += new_text
        return self._find_stop(start)

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

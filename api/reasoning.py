"""Reasoning output (`--reasoning-parser`): the text a reasoning model writes inside `<think>...</think>` goes to
`reasoning_content` (`delta.reasoning_content` when streaming); what follows `</think>` is the content.

One state machine reads both the whole text and a stream of deltas, so the streamed reasoning and content
concatenate to exactly the non-streamed ones. A delta's trailing characters that may begin a marker are held back
until the next delta (or the end) decides.

A constraint (response_format, structured_outputs, a forced tool call) applies to the answer after `</think>`
only: the engine's grammar starts after the end-of-thinking token (StructuredOutputsParams.after_thinking, from
`ReasoningParser.thinking_tokens`), so the markers must be single tokens of the model's tokenizer, as they are in
Qwen3's and DeepSeek-R1's. The engine's rule for where the thinking is matches this parser's, token for text: a
`<think>` token starts a thinking only as the output's first token (qwen3), or the output starts inside it
(deepseek_r1).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from asyncengine.sampling_params import ThinkingTokens

START, END = "<think>", "</think>"


@dataclass
class ReasoningParser:
    """starts_thinking: the output begins inside the thinking (DeepSeek-R1, whose template ends the prompt with
    `<think>`); else it thinks only when it begins with `<think>` (Qwen3, where thinking can be switched off)."""

    starts_thinking: bool

    def thinking_tokens(self, tokenizer, name: str) -> ThinkingTokens:
        """The token ids of the markers, for constraining only the answer; ValueError naming reasoning_parser
        when the tokenizer does not hold each marker as one token."""
        ids = {}
        for marker in (START, END):
            encoded = tokenizer.encode(marker, add_special_tokens=False)
            if len(encoded) != 1:
                raise ValueError(f"reasoning_parser {name} needs {marker!r} to be one token of the model's "
                                 f"tokenizer (it encodes to {len(encoded)} tokens), so that a constraint can start "
                                 "after the thinking")
            ids[marker] = encoded[0]
        return ThinkingTokens(end=ids[END], start=None if self.starts_thinking else ids[START])


REASONING_PARSERS = {
    "qwen3": ReasoningParser(starts_thinking=False),
    "deepseek_r1": ReasoningParser(starts_thinking=True),
}


def _held(text: str, marker: str) -> int:
    """How many trailing characters of text are a proper prefix of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """Splits one choice's text, fed in deltas, into (reasoning, content) pieces."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.state = "start"  # "start": before the first non-blank text decides; "think"; "content"
        self.pending = ""

    def feed(self, delta: str) -> tuple[str, str]:
        self.pending += delta
        reasoning, content = "", ""
        while self.pending:
            if self.state == "start":
                stripped = self.pending.lstrip()
                if START.startswith(stripped):  # blank, or a part of "<think>" so far: wait
                    if stripped == START:
                        self.state, self.pending = "think", ""
                    break
                if stripped.startswith(START):
                    self.state, self.pending = "think", stripped[len(START):]
                else:
                    self.state = "think" if self.parser.starts_thinking else "content"
            elif self.state == "think":
                end = self.pending.find(END)
                if end >= 0:
                    reasoning += self.pending[:end]
                    self.state, self.pending = "content", self.pending[end + len(END):]
                    continue
                keep = _held(self.pending, END)
                reasoning += self.pending[:len(self.pending) - keep]
                self.pending = self.pending[len(self.pending) - keep:]
                break
            else:
                content += self.pending
                self.pending = ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        """What was held back: the end of the thinking, or content that only looked like a marker's start."""
        rest, self.pending = self.pending, ""
        if self.state == "think" or (self.state == "start" and self.parser.starts_thinking):
            return rest, ""
        return "", rest


def split_reasoning(parser: ReasoningParser, text: str) -> tuple[Optional[str], str]:
    """(reasoning_content, None when there is none; content) of a whole output."""
    stream = ReasoningStream(parser)
    reasoning, content = stream.feed(text)
    more_reasoning, more_content = stream.finish()
    return (reasoning + more_reasoning) or None, content + more_content

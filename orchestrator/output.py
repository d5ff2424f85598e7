"""The generated output as the user sees it: stop conditions and incremental text.

Strategies hand over tokens as they are decided, possibly several at once (a speculative round);
`Output.extend` keeps exactly those before the first stop: an eos (kept, as transformers keeps
it), `max_new_tokens`, or the first occurrence of a stop string in the generated text (the
prompt's text is not searched).

Stop strings are exact, for every strategy and over unary and streaming alike: `text` ends just
before the earliest match, whichever round its first characters arrived in, and `token_ids` end
with the token that completed it (so the ids may decode to more than `text`). While generating,
`text_delta` holds back any tail of the text that could still become the start of a stop string
(and a trailing partial UTF-8 character), so nothing streamed is ever taken back.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

from transformers import PreTrainedTokenizerBase

REPLACEMENT_CHAR = "\ufffd"


def stop_prefix_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of one of `stops`: the
    characters that may yet turn out to begin a stop string."""
    longest = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:length]):
                longest = length
                break
    return longest


@dataclass
class Output:
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: frozenset[int]
    max_new_tokens: int
    stop: tuple[str, ...] = ()
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    _stop_text: str | None = None
    _emitted_chars: int = 0
    # The texts of the last two prefixes decoded, as (token count, text). `token_ids` only
    # grows, or is cut once at a stop, so a prefix's text never changes.
    _decoded: list[tuple[int, str]] = field(default_factory=list)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def decode(self, ids: list[int]) -> str:
        return cast(str, self.tokenizer.decode(ids, skip_special_tokens=True))

    def _prefix_text(self, count: int) -> str:
        """The text of the first `count` tokens, decoded once per step rather than per use."""
        cached = [text for decoded_count, text in self._decoded if decoded_count == count]
        text = cached[0] if cached else self.decode(self.token_ids[:count])
        # Most recently used first: the whole text of one step is the prefix of the next.
        self._decoded = [(count, text), *[entry for entry in self._decoded if entry[0] != count][:1]]
        return text

    @property
    def text(self) -> str:
        return self._stop_text if self._stop_text is not None else self._prefix_text(len(self.token_ids))

    def extend(self, ids: list[int]) -> list[int]:
        """Take the decided `ids`; return those kept (a prefix of them)."""
        start = len(self.token_ids)
        for token in ids:
            if self.done:
                break
            self.token_ids.append(token)
            if token in self.eos_token_ids:
                self.finish_reason = "eos"
            elif len(self.token_ids) >= self.max_new_tokens:
                self.finish_reason = "length"
        if self.stop:
            self._check_stop(start)
        return self.token_ids[start:]

    def _check_stop(self, start: int) -> None:
        text = self._prefix_text(len(self.token_ids))
        # Only a match that ends in the new tokens' text can be new.
        search_from = max(0, len(self._prefix_text(start)) - max(len(s) for s in self.stop))
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if not hits:
            return
        cut = min(hits)
        # Keep tokens up to the one whose text completes the stop string.
        for count in range(start + 1, len(self.token_ids) + 1):
            prefix = self.decode(self.token_ids[:count])
            if any(s in prefix for s in self.stop):
                del self.token_ids[count:]
                break
        self._stop_text = text[:cut]
        self.finish_reason = "stop"

    def text_delta(self) -> str:
        """Text not yet emitted. Unless done, holds back a trailing partial UTF-8 character and
        the longest tail that is a proper prefix of a stop string."""
        text = self.text
        end = len(text)
        if not self.done:
            end -= stop_prefix_len(text, self.stop)
            while end > self._emitted_chars and text[end - 1] == REPLACEMENT_CHAR:
                end -= 1
            end = max(end, self._emitted_chars)
        delta = text[self._emitted_chars : end]
        self._emitted_chars = end
        return delta

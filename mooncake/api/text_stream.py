"""Incremental detokenization with stop strings, in constant work per token.

The text of generated ids is built from deltas: each step decodes only a short
window — the ids last turned into text (context, so that tokenizers that treat
a word's leading space specially decode the same way) plus the new ones — and
keeps what the new ids add. Text ending in an incomplete UTF-8 sequence is held
until the ids that complete it arrive, and so is a tail that may still grow into
a stop string. A stop string is never emitted.
"""

from __future__ import annotations

from typing import Any, Sequence

class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.prefix = 0  # window start: ids before it are settled and only give context
        self.read = 0  # ids before it are in ``text``
        self.text = ""  # decoded so far (a stop string and what follows cut off)
        self.emitted = 0  # characters of ``text`` already handed out
        self.stopped = False

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; returns the new text that is safe to emit."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self._advance(final=False)
        if self.stopped:
            return self._take(len(self.text))
        safe = len(self.text)
        for s in self.stop:  # hold back a tail that may still grow into a stop string
            for k in range(min(len(s) - 1, safe - self.emitted), 0, -1):
                if self.text[safe - k:safe] == s[:k]:
                    safe -= k
                    break
        return self._take(safe)

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        if not self.stopped:
            self._advance(final=True)
        return self._take(len(self.text))

    def _advance(self, final: bool) -> None:
        """Turn the ids after ``read`` into text, unless they end inside a character."""
        if self.read == len(self.ids):
            return
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if final or (len(window) > len(before) and not window.endswith("\ufffd")):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)
            for s in self.stop:
                at = self.text.find(s, max(0, self.emitted - len(s) + 1))
                if at != -1:
                    self.text = self.text[:at]
                    self.stopped = True

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

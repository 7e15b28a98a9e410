"""Incremental detokenization with stop strings, in constant work per token.

The text of generated ids is built from deltas: each step decodes only a short
window — the ids last turned into text (context, so that tokenizers that treat
a word's leading space specially decode the same way) plus the new ones — and
keeps what the new ids add. Text ending in an incomplete UTF-8 sequence is held
until the ids that complete it arrive, and so is a tail that may still grow into
a stop string. A stop string is never emitted.

Ids that add no text yet (special tokens, which are skipped; a lone "▁" that may become a
space) or that never complete a character (lone UTF-8 lead bytes, which ``logit_bias`` can
force) keep the window from moving: decoding the growing window on every token would cost
quadratic work. Past ``MAX_HELD_IDS`` held ids the window is decoded again only when the held
ids have grown by a quarter since the last try (and at the end), so the work stays linear, text
that follows them waits at most a quarter of their number, and the text is exact (committing them
as "no text" early could drop the space a later id gives them).
"""

from __future__ import annotations

from typing import Any, Sequence

MAX_HELD_IDS = 8

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
        self._retry_at = 0  # with more than MAX_HELD_IDS held: how many held ids make the next try

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
        held = len(self.ids) - self.read
        if held == 0 or (not final and held < self._retry_at):
            return
        before = self._decode(self.ids[self.prefix:self.read])
        window = self._decode(self.ids[self.prefix:])
        if not (final or (len(window) > len(before) and not window.endswith("\ufffd"))):
            if held > MAX_HELD_IDS:
                self._retry_at = held + held // 4
        else:
            self._retry_at = 0
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

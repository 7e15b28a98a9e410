"""Incremental detokenization with stop strings.

Output text is the decoding of all generated ids so far; what is emitted is the
part that can no longer change: text ending in an incomplete UTF-8 sequence, or
in a prefix of a stop string, is held back. A stop string is never emitted.
"""

from __future__ import annotations

from typing import Any, Sequence


class TextStream:
    def __init__(self, tokenizer: Any, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.ids: list[int] = []
        self.emitted = 0  # characters of the decoded text already handed out
        self.text = ""
        self.stopped = False

    def push(self, ids: Sequence[int]) -> str:
        """Add generated ids; returns the new text that is safe to emit."""
        if self.stopped:
            return ""
        self.ids.extend(ids)
        self.text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        for s in self.stop:
            at = self.text.find(s, max(0, self.emitted - len(s) + 1))
            if at != -1:
                self.text = self.text[:at]
                self.stopped = True
        if self.stopped:
            return self._take(len(self.text))
        safe = len(self.text)
        while safe > self.emitted and self.text[safe - 1] == "\ufffd":
            safe -= 1
        for s in self.stop:  # hold back a tail that may still grow into a stop string
            for k in range(min(len(s) - 1, safe - self.emitted), 0, -1):
                if self.text[safe - k:safe] == s[:k]:
                    safe -= k
                    break
        return self._take(safe)

    def flush(self) -> str:
        """At the end of generation: whatever was held back."""
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        out = self.text[self.emitted:end]
        self.emitted = end
        return out

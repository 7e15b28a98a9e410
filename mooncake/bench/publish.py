"""A benchmark's result: printed, and written to ``--out`` when given."""

from __future__ import annotations

from pathlib import Path


def publish(text: str, out: str | Path | None) -> None:
    print(text)
    if out:
        Path(out).write_text(text.rstrip("\n") + "\n")

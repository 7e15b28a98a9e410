"""The bench tool's progress bar (tqdm on stderr), with the outcome counts as its postfix."""

from __future__ import annotations

import sys
from typing import TextIO

from tqdm import tqdm

from mooncake.bench.client import RequestRecord


class ProgressBar:
    """``12/40 [00:03<00:07, ok=10, 429=1, err=1]``; disabled: nothing is written."""

    def __init__(self, total: int, enabled: bool = True, stream: TextIO | None = None) -> None:
        self.ok = self.rejected = self.errors = 0
        self.bar = tqdm(total=max(total, 1), disable=not enabled, file=stream if stream is not None else sys.stderr,
                        unit="req", dynamic_ncols=True, mininterval=0.1)

    @property
    def done(self) -> int:
        return int(self.bar.n)

    def update(self, record: RequestRecord) -> None:
        if record.ok:
            self.ok += 1
        elif record.rejected:
            self.rejected += 1
        else:
            self.errors += 1
        self.bar.set_postfix({"ok": self.ok, "429": self.rejected, "err": self.errors}, refresh=False)
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()

"""Where a request's time went, as its frontend saw it: consecutive segments of its wall time, each
credited to one component, so that they sum to the whole (``access_log`` lines in JSON mode and
``GET /v1/requests/{id}`` show them; ``recent_requests.py`` keeps the finished ones a while).

From its arrival (the prompt tokenized) to its end: ``queue`` (waiting to be placed: the plan's
round trip to the conductor, admission), ``reserve_wait`` (the decode reserving KV room),
``prefill_queue``, ``prefix_load`` and ``prefill_compute`` (what the prefill reported of its time
between the reservation and the first token), ``kv_transfer`` (the first token until the
second: the KV landing on decode and its first step), ``decode`` (the later tokens, ``decode_steps``
of them), ``retry`` (attempts preempted or migrated, until the next one was placed) and ``other``
(the last token until the end). Around it the HTTP request adds ``prepare`` (parse, template,
tokenize) and ``respond`` (the end until the response is out)."""

from __future__ import annotations

from dataclasses import dataclass, field

COMPONENTS = ("prepare", "queue", "reserve_wait", "prefill_queue", "prefix_load", "prefill_compute", "kv_transfer",
              "decode", "retry", "other", "respond")


@dataclass(eq=False)
class Timeline:
    arrived: float  # time.monotonic()
    mark: float = 0.0  # the end of what is credited so far
    seconds: dict[str, float] = field(default_factory=dict)
    phase: str = "queue"  # what the time since ``mark`` goes to: queue, decoding (kv_transfer, then decode)
    ttft_s: float = 0.0
    decode_steps: int = 0
    preemptions: int = 0
    migrations: int = 0
    cached_tokens: int = 0
    fetched_blocks: int = 0
    prefix_from: str = "none"  # device | store | none: where its reused prefix came from
    finished: float = 0.0

    def __post_init__(self) -> None:
        self.mark = self.mark or self.arrived

    def _credit(self, component: str, until: float) -> None:
        if until > self.mark:
            self.seconds[component] = self.seconds.get(component, 0.0) + until - self.mark
            self.mark = until

    def prefilled(self, placed: float, reserved: float, now: float, prefill_s: float, fetch_s: float,
                  cached_tokens: int, fetched_blocks: int, first: bool) -> None:
        """An attempt's prefill reported (placed, reserved on decode, reported: ``time.monotonic()``)."""
        self._credit("retry" if self.phase == "retry" else "queue", placed)
        self._credit("reserve_wait", max(placed, reserved))
        span = max(0.0, now - self.mark)
        load = min(max(0.0, fetch_s), span)
        compute = min(max(0.0, prefill_s), span - load)
        for component, s in (("prefill_queue", span - load - compute), ("prefix_load", load), ("prefill_compute", compute)):
            if s > 0:
                self.seconds[component] = self.seconds.get(component, 0.0) + s
        self.mark = max(self.mark, now)
        self.phase = "first_token"
        if first:
            self.ttft_s = now - self.arrived
            self.cached_tokens, self.fetched_blocks = cached_tokens, fetched_blocks
            self.prefix_from = "store" if fetched_blocks else "device" if cached_tokens else "none"

    def tokens(self, emitted: int, now: float) -> None:
        if self.phase == "first_token":
            self._credit("kv_transfer", now)
            self.phase = "decoding"
        elif self.phase == "decoding":
            self._credit("decode", now)
        self.decode_steps += emitted

    def moved(self, preempted: bool, now: float) -> None:
        self._credit("retry", now)
        self.phase = "retry"
        if preempted:
            self.preemptions += 1
        else:
            self.migrations += 1

    def finish(self, now: float) -> None:
        self._credit("retry" if self.phase == "retry" else "queue" if self.phase == "queue" else "other", now)
        self.finished = now

    def breakdown(self) -> dict:
        """The components (seconds, rounded to µs), wall time, and what they count."""
        out: dict = {f"{c}_s": round(self.seconds.get(c, 0.0), 6) for c in COMPONENTS if c in self.seconds}
        out.update({"wall_s": round(self.finished - self.arrived, 6), "ttft_s": round(self.ttft_s, 6),
                    "decode_steps": self.decode_steps, "preemptions": self.preemptions,
                    "migrations": self.migrations, "cached_tokens": self.cached_tokens,
                    "fetched_blocks": self.fetched_blocks, "prefix_from": self.prefix_from})
        return out

    def around(self, started: float, ended: float) -> dict:
        """The breakdown of the HTTP request that ran from ``started`` to ``ended``: with ``prepare``
        and ``respond`` added, its components sum to that wall time."""
        out = self.breakdown()
        out["prepare_s"] = round(max(0.0, self.arrived - started), 6)
        out["respond_s"] = round(max(0.0, ended - (self.finished or ended)), 6)
        out["wall_s"] = round(ended - started, 6)
        return out

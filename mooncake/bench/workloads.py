"""Workloads: sessions of one or more turns, each turn's new prompt tokens.

A :class:`Session` is what the runner schedules: a trace request is a
one-turn session; the synthetic shared-prefix workload makes multi-turn
conversations whose later turns append the server's previous answer.
"""

from __future__ import annotations

from dataclasses import dataclass

from mooncake.bench.prompts import TokenRange, seeded_token_ids

_PREFIX_SEED = 0x707265  # "pre"
_SUFFIX_SEED = 0x737566  # "suf"


@dataclass(frozen=True)
class Session:
    """A conversation: per turn, the new user tokens and the max_tokens to ask for."""

    session_id: str
    turns: tuple[tuple[int, ...], ...]
    max_tokens: tuple[int, ...]
    arrival_s: float | None = None
    """Arrival offset from the start (s), when the workload carries its own timing."""

    def __post_init__(self) -> None:
        if not self.turns or len(self.turns) != len(self.max_tokens):
            raise ValueError("a session needs >= 1 turn and one max_tokens per turn")

    @property
    def num_requests(self) -> int:
        return len(self.turns)


@dataclass(frozen=True)
class SharedPrefixSpec:
    """Groups of conversations; conversations of a group share a system prefix."""

    groups: int = 4
    sessions_per_group: int = 4
    prefix_tokens: int = 256
    """Tokens shared by every first turn of a group."""
    suffix_tokens: int = 32
    """Unique tokens per conversation turn (appended after the prefix / history)."""
    turns: int = 1
    output_tokens: int = 32
    seed: int = 0
    repeats: int = 1
    """Copies of the whole workload, one after the other, each on groups of its own (copy
    ``r`` draws the prefixes of groups ``r * groups ...``): a copy shares within itself what
    the workload shares, and nothing with another copy."""

    def __post_init__(self) -> None:
        for name in ("groups", "sessions_per_group", "turns", "output_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.prefix_tokens < 0 or self.suffix_tokens < 0:
            raise ValueError("prefix_tokens and suffix_tokens must be >= 0")
        if self.prefix_tokens + self.suffix_tokens < 1:
            raise ValueError("a prompt needs at least one token (prefix + suffix >= 1)")
        if self.turns > 1 and self.suffix_tokens < 1:
            raise ValueError("later turns need new user tokens (suffix_tokens >= 1)")


def shared_prefix_sessions(spec: SharedPrefixSpec, token_range: TokenRange) -> list[Session]:
    """Build the sessions, interleaved across groups (g0s0, g1s0, ..., g0s1, ...), copy after
    copy when ``spec.repeats`` > 1.

    Later turns carry only their new user tokens; the runner prepends the
    history (previous prompts and answers).
    """
    sessions = []
    for r in range(spec.repeats):
        groups = range(r * spec.groups, (r + 1) * spec.groups)
        prefixes = {g: seeded_token_ids((spec.seed, _PREFIX_SEED, g), spec.prefix_tokens, token_range)
                    for g in groups}
        for s in range(spec.sessions_per_group):
            for g in groups:
                turns = []
                for t in range(spec.turns):
                    suffix = seeded_token_ids((spec.seed, _SUFFIX_SEED, g, s, t), spec.suffix_tokens,
                                              token_range)
                    turns.append(tuple((prefixes[g] if t == 0 else []) + suffix))
                sessions.append(Session(session_id=f"g{g}-s{s}", turns=tuple(turns),
                                        max_tokens=(spec.output_tokens,) * spec.turns))
    return sessions

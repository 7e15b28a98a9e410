"""Deterministic prompt material: token ids from seeds, and their text rendering.

``tokens`` mode sends token ids (exact counts). ``text`` mode, for servers that
accept only text, maps every id to a common English word that most BPE
vocabularies encode as one token, so N ids become about N tokens of text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Common short English words; with a leading space each is one token in
# GPT-2/Llama/SmolLM style BPE vocabularies.
WORDS: tuple[str, ...] = tuple("""
the of and to in is was for on that with as by at from his her they this be are
or had not but which have one were all we when there can an your their said if
do will each about how up out them then she many some so these would other into
has more two like him see time could no make than first been its who now people
my made over did down only way find use may water long little very after words
called just where most know get through back much go good new write our me man
too any day same right look think also around another came come work three word
must because does part even place well such here take why things help put years
different away again off went old number great tell men say small every found
still between name should home big give air line set own under read last never
us left end along while might next sound below saw something thought both few
those always looked show large often together asked house world going want school
important until form food keep children feet land side without boy once animals
life enough took sometimes four head above kind began almost live page got earth
need far hand high year mother light parts country father let night following
picture being study second eyes soon times story boys since white days ever paper
hard near sentence better best across during today others however sure means knew
try told young miles sun ways thing whole hear example heard several change answer
room sea against top turned learn point city play toward five using himself usually
""".split())


@dataclass(frozen=True)
class TokenRange:
    """Half-open range [lo, hi) of token ids safe to send (no special tokens)."""

    lo: int = 1000
    hi: int = 30000

    def __post_init__(self) -> None:
        if not 0 <= self.lo < self.hi:
            raise ValueError(f"token range must satisfy 0 <= lo < hi, got {self.lo}:{self.hi}")

    @property
    def span(self) -> int:
        return self.hi - self.lo

    @classmethod
    def parse(cls, text: str) -> "TokenRange":
        """Parse ``LO:HI``."""
        lo, sep, hi = text.partition(":")
        if not sep:
            raise ValueError(f"token range must be LO:HI, got {text!r}")
        return cls(int(lo), int(hi))


def seeded_token_ids(seed: tuple[int, ...], n: int, token_range: TokenRange) -> list[int]:
    """``n`` pseudo-random ids in the range, a pure function of ``seed``."""
    rng = np.random.default_rng(list(seed))
    return rng.integers(token_range.lo, token_range.hi, size=n).tolist()


def block_token_ids(hash_id: int, n: int, token_range: TokenRange, salt: int = 0) -> list[int]:
    """The ``n`` tokens a trace hash id expands to.

    The first token encodes the id itself (modulo the range), so blocks with
    different ids never agree on their first token unless the ids are
    congruent modulo the range's span: shared prefixes end exactly at the
    first differing block. A non-zero ``salt`` draws other tokens for every
    block, the first shifted by the salt (same sharing structure within one salt, no
    block in common with another salt's).
    """
    seed = (0x6D6F6F6E, hash_id) if salt == 0 else (0x6D6F6F6E, salt, hash_id)
    ids = seeded_token_ids(seed, n, token_range)
    if ids:
        ids[0] = token_range.lo + (hash_id + salt) % token_range.span
    return ids


def ids_to_text(ids: list[int] | tuple[int, ...]) -> str:
    """Render ids as words: one word per id, joined with spaces."""
    return " ".join(WORDS[i % len(WORDS)] for i in ids)

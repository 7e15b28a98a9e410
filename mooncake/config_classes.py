"""``[classes]``: request classes' SLOs and limits (``sched/request_class.py``), API keys bound to
a class, and how long a session's prefix is kept."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from pydantic import Field, field_validator, model_validator

from mooncake.config_section import Section, split_list

log = logging.getLogger(__name__)


class ClassLimits(Section):
    """One class's SLOs and limits (``[classes.priority]``, ``[classes.default]``, ``[classes.flex]``).
    A key left unset takes [admission]'s; [classes.flex] has its own defaults (``FLEX_DEFAULTS``)."""

    ttft_slo_ms: float | None = Field(None, ge=0, description="Time-to-first-token SLO of the class's requests (early rejection against it, counting the work queued ahead of them); 0: none; unset: [admission] ttft_slo_ms.")
    tbt_slo_ms: float | None = Field(None, ge=0, description="Time-between-tokens SLO of the class's requests (early rejection; a decode lets flex sequences into a step only while it holds for the interactive ones it runs); 0: none; unset: [admission] tbt_slo_ms.")
    max_waiting: int | None = Field(None, ge=1, description="Requests of the class queued for prefill cluster-wide before new ones of it get 503; unset: [admission] max_waiting.")
    max_queue_wait_s: float | None = Field(None, ge=0, description="A request of the class predicted to wait longer than this before its prompt computes is refused with 429 and a Retry-After; 0: never; unset: [admission] max_queue_wait_s.")
    request_timeout_s: float | None = Field(None, gt=0, description="A request of the class with no progress this long moves, then fails (flex work may wait behind the rest that long; workers that die or stall are found apart from it); unset: [admission] request_timeout_s.")
    max_share: float = Field(1.0, gt=0, le=1, description="Share of [admission] max_requests the class's requests may hold in flight; past it new ones of the class get 503, so that the other classes keep room.")


PRIORITY_DEFAULTS = ClassLimits(max_share=0.8)  # the classes below always keep room
FLEX_DEFAULTS = ClassLimits(ttft_slo_ms=0.0, tbt_slo_ms=0.0, max_waiting=256, max_queue_wait_s=0.0, request_timeout_s=3600.0,
                            max_share=0.5)
# [classes] keys of an earlier layout, now in [classes.flex]
MOVED_TO_FLEX = {"flex_ttft_slo_ms": "ttft_slo_ms", "flex_request_timeout_s": "request_timeout_s",
                 "flex_max_waiting": "max_waiting"}
# [classes] keys renamed in place (old -> new): the old name still works, in TOML and as its
# MOONCAKE_ variable, with a warning (a request class is never called a tier: a tier is a store's)
RENAMED_CLASS_KEYS = {"api_key_tiers": "api_key_classes"}
RENAMED_KEYS = {("classes", old): ("classes", new) for old, new in RENAMED_CLASS_KEYS.items()}  # as config paths


@dataclass(frozen=True)
class KeyTerms:
    """What requests authenticated by one API key may ask for: ``request_class``, the class they get
    when they name none and the highest they may name (a higher one is served at it); ``min_priority``,
    the most urgent integer ``priority`` they may send (lower ones are raised to it); ``weight``,
    their share in the fair order among keys within a class (README "Request classes")."""

    request_class: str = "default"
    min_priority: int = 0
    weight: float = 1.0


def key_terms(entry: str) -> tuple[str, KeyTerms]:
    """``KEY=CLASS[;min_priority=N][;weight=W]`` as (key, terms); ValueError where it is not that."""
    head, *options = entry.split(";")
    key, sep, request_class = head.rpartition("=")
    if not sep or not key or request_class not in ("default", "priority", "flex"):
        raise ValueError("api_key_classes: each entry is KEY=CLASS with CLASS default, priority or flex, "
                         "then ;min_priority=N and ;weight=W if wanted")
    fields: dict[str, Any] = {"request_class": request_class}
    for option in options:
        name, _, value = option.partition("=")
        try:
            if name == "min_priority":
                fields[name] = int(value)
            elif name == "weight" and float(value) > 0:
                fields[name] = float(value)
            else:
                raise ValueError
        except ValueError:
            raise ValueError(f"api_key_classes: {option!r} is not min_priority=N (an integer) or weight=W "
                             "(a number above 0)") from None
    return key, KeyTerms(**fields)


class ClassesConfig(Section):
    """Request classes (``service_tier``; README "Request classes"): ``priority`` and ``default``
    are interactive (``priority`` within 0.8 of ``max_requests``, so the others always keep room);
    ``flex`` waits behind them, never refused for their SLOs, within its own limits ([classes.flex])."""

    priority: ClassLimits = PRIORITY_DEFAULTS
    default: ClassLimits = ClassLimits()
    flex: ClassLimits = FLEX_DEFAULTS
    flex_chunk_tokens: int = Field(256, ge=0, description="Tokens per prefill forward of flex work (the [engine] prefill_chunk_tokens of interactive work): an interactive prompt that arrives while one computes waits for it to end, so shorter lets it in sooner, at some cost to flex throughput (the weights are read once per forward); 0: [engine] prefill_chunk_tokens.")
    api_key_classes: list[str] = Field(default_factory=list, description="KEY=CLASS entries (comma-separated in MOONCAKE_CLASSES_API_KEY_CLASSES), each optionally followed by ;min_priority=N and ;weight=W: a request authenticated by KEY is served in CLASS when it names no service_tier and at most in CLASS when it names a higher one (a batch job's key: flex; only keys bound to priority may use priority); its integer priority is raised to N (default 0: no key cuts ahead of another's requests of its class); W weighs its share in the fair order among keys within a class (default 1). A key without an entry: default, 0 and 1. No API keys: no tenants, every class and priority open. Its old name api_key_tiers (MOONCAKE_CLASSES_API_KEY_TIERS) still works, with a warning.")
    session_ttl_s: float = Field(600.0, ge=0, le=7 * 86400, description="A request naming a session (the extension field session_id, or OpenAI's user where session_from_user is on; a flex request only by session_id) has its prefix's KV blocks kept this long after its turn: evicted only after every block no session keeps, in the prefill's cache and in the stores, so that the session's next turn hits under pressure (a store's restart forgets it); 0: off.")
    fair_token_ms: float = Field(10.0, gt=0, le=1000, description="The tenants' fair order within a class (README \"Request classes\"): each prompt token a tenant sends moves its clock this much, so a tenant sending up to 1000/fair_token_ms tokens a second has its requests taken in arrival order among others', and one sending more has its later ones ordered after those of tenants that sent less. Above the machine's real cost per token (about 1 ms on a small CPU, far less on a GPU), so that a burst is pushed back behind the requests that arrive while it is served.")
    session_from_user: bool = Field(False, description="OpenAI's user field names a session too (for clients that send no session_id); off: only session_id does, since many clients send user on every request.")
    session_blocks_per_key: int = Field(4096, ge=0, description="Blocks the sessions of one API key (tenant; no keys: one tenant) may keep at once in each engine's prefix cache and in each store: past it the tenant's oldest kept blocks become ordinary (evicted in LRU order), so that no tenant pins another's room; 0: no limit.")
    store_write_share_per_key: float = Field(1.0, ge=0, description="With API keys, the bytes one key may write to a store per minute, as a share of that store's capacity: past it the rest of its writes are dropped (recomputed or read from elsewhere when asked for), so one tenant's flood of unique prompts cannot turn over the store the other tenants' prefixes live in faster than this; 0: no limit. Without keys there is no limit.")
    session_share_per_key: float = Field(0.25, ge=0, le=1, description="With API keys, the share of each engine's prefix cache and each store's capacity that one key's sessions may keep at once (the smaller of it and session_blocks_per_key applies), so that a few tenants' sessions never pin the room every other tenant's prefixes need; 0: only the count. Without keys the one tenant's sessions may keep the whole cache.")

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, raw: object) -> object:
        """[classes] flex_ttft_slo_ms, flex_request_timeout_s and flex_max_waiting still work, with a
        warning, as [classes.flex] keys ([classes.flex] wins where both set one); a renamed key
        (``RENAMED_CLASS_KEYS``) under its old name too (the new name wins where both are set)."""
        if not isinstance(raw, dict) or not (MOVED_TO_FLEX.keys() | RENAMED_CLASS_KEYS.keys()) & raw.keys():
            return raw
        raw = dict(raw)
        for old in RENAMED_CLASS_KEYS.keys() & raw.keys():
            new, value = RENAMED_CLASS_KEYS[old], raw.pop(old)
            log.warning("[classes] %s (MOONCAKE_CLASSES_%s) is deprecated: use %s (MOONCAKE_CLASSES_%s); read "
                        "under its old name this time", old, old.upper(), new, new.upper())
            raw.setdefault(new, value)
        if not MOVED_TO_FLEX.keys() & raw.keys():
            return raw
        moved = {MOVED_TO_FLEX[k]: raw.pop(k) for k in list(raw) if k in MOVED_TO_FLEX}
        log.warning("[classes] %s moved to [classes.flex] (%s)", ", ".join(f"flex_{k}" for k in sorted(moved)),
                    ", ".join(sorted(moved)))
        flex = raw.get("flex")
        base = flex.model_dump(exclude_unset=True) if isinstance(flex, ClassLimits) else flex if isinstance(flex, dict) else {}
        raw["flex"] = {**moved, **base}
        return raw

    @field_validator("priority", "flex", mode="before")
    @classmethod
    def _class_defaults(cls, v: object, info: Any) -> object:
        """Keys a [classes.priority] or [classes.flex] table leaves out keep that class's defaults."""
        if isinstance(v, dict):
            defaults = PRIORITY_DEFAULTS if info.field_name == "priority" else FLEX_DEFAULTS
            return {**defaults.model_dump(exclude_unset=info.field_name == "priority"), **v}
        return v

    @field_validator("api_key_classes", mode="before")
    @classmethod
    def _split_pairs(cls, v: object) -> object:
        return split_list(v, "api_key_classes")

    @field_validator("api_key_classes")
    @classmethod
    def _check_pairs(cls, v: list[str]) -> list[str]:
        for entry in v:
            key_terms(entry)
        return v

    def limit(self, request_class: str, key: str, admission: Any) -> Any:
        """``key`` of class ``request_class``: its [classes.<class>] value, else ``admission``'s ([admission])."""
        value = getattr(getattr(self, request_class), key)
        return getattr(admission, key) if value is None else value

    def terms_of_key(self, api_key: str) -> KeyTerms:
        """What ``api_key``'s requests may ask for (``KeyTerms()`` for a key without an entry)."""
        for entry in self.api_key_classes:
            key, terms = key_terms(entry)
            if key == api_key:
                return terms
        return KeyTerms()

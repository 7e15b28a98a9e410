"""Request classes: which queued work goes first when interactive and batch traffic share a
cluster (issue 32).

A request names its class with OpenAI's ``service_tier``: ``default`` (what ``auto`` and no
class get) is interactive traffic; ``priority`` goes ahead of it; ``flex`` (batch jobs,
evaluations: no tight SLO) goes behind both. vLLM's integer ``priority`` orders requests
within a class, lower first; among requests of one class and priority, API keys (tenants)
take turns by a fair order (``fair_tag``). All ride on a request's ``Sampling``, so every order
a worker receives carries them; a worker's queue serves by ``urgency``, then arrival.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable, Sequence

if TYPE_CHECKING:
    from mooncake.config import Config

_RANK = {"priority": 0, "default": 1, "flex": 2}  # served first to last
RANKS = len(_RANK)
CLASSES = tuple(_RANK)  # by rank
DEFAULT_RANK = _RANK["default"]
FLEX_RANK = _RANK["flex"]


def served_class(requested: str | None, key_class: str | None = None) -> str:
    """The class a request asking for ``requested`` is served in (what its response says):
    ``auto`` or none leave it to the server, which serves the class bound to the caller's API key
    (``key_class``), else ``default``. The key's class is also the highest it may ask for: a higher
    one is served at it. No key (None): every class is open."""
    cls_name = requested if requested not in (None, "auto") else key_class or "default"
    return key_class if key_class is not None and _RANK[cls_name] < _RANK[key_class] else cls_name


def urgency(sampling: Any) -> tuple[int, int, float]:
    """Sort key of a request's work (lower first): its class, then its ``priority``, then its place
    in the fair order among tenants (``fair_tag``: ``frontend/tenant_clock.py``)."""
    return rank(sampling), sampling.priority, sampling.fair_tag


def tenant_urgency(sampling: Any) -> tuple[int, int, float, str]:
    """``urgency`` with the request's tenant beside it: where one engine thread serves several
    tenants, a call of one class and priority gives way to another tenant's earlier turn, never
    to its own tenant's other requests (``roles/engine_thread.py``)."""
    return (*urgency(sampling), sampling.tenant)


def yields_to(holder: Any, asker: Any) -> bool:
    """Whether a sequence of ``holder`` (sampling) gives its KV room to a request of ``asker`` waiting
    for room: flex work to interactive work, and another tenant's work that comes later in the
    order (class, priority, fair tag). One tenant's own requests never preempt each other."""
    if rank(asker) == FLEX_RANK:
        return False
    return rank(holder) == FLEX_RANK or (holder.tenant != asker.tenant and urgency(holder) > urgency(asker))


def rank(sampling: Any) -> int:
    """Where a request's class is served: 0 first, ``FLEX_RANK`` last."""
    return _RANK.get(sampling.request_class, DEFAULT_RANK)


# Flex work in a step that decodes interactive rows (flex rows joining it, flex prompts' chunks) may
# make it at most this much longer than those rows' own step: background work costs an interactive
# token half its step time and 20 ms at most, whatever room its TBT target leaves.
FLEX_STEP_SHARE, FLEX_STEP_FLOOR_S = 0.5, 0.020


def flex_allowance_s(interactive_step_s: float, target_s: float) -> float:
    """How long a step whose interactive rows alone take ``interactive_step_s`` may take once flex
    work joins it: within the rows' TBT target ``target_s`` (0: none), and longer than their own
    step by ``FLEX_STEP_SHARE`` of it and ``FLEX_STEP_FLOOR_S`` at most."""
    allowance = interactive_step_s * (1 + FLEX_STEP_SHARE) + FLEX_STEP_FLOOR_S
    return min(target_s, allowance) if target_s else allowance


def flex_joining(interactive: int, interactive_kv: int, flex_kv: Sequence[int],
                 step_s: Callable[[int, int], float], slo_s: float) -> int:
    """How many of the flex sequences (``flex_kv``: their KV tokens, in the order they join)
    a decode step of ``interactive`` other sequences (holding ``interactive_kv``) takes while
    its predicted time (``step_s(batch, KV tokens)``) stays within the interactive TBT SLO
    ``slo_s``: flex work fills the batch only where the others lose nothing to it. All of
    them with no SLO (``slo_s`` 0) or no interactive sequence to protect."""
    if not slo_s or not interactive:
        return len(flex_kv)
    batch, kv = interactive, interactive_kv
    for n, tokens in enumerate(flex_kv):
        if step_s(batch + 1, kv + tokens) > slo_s:
            return n
        batch, kv = batch + 1, kv + tokens
    return len(flex_kv)


def tbt_target_ms(sampling: Any, cfg: Config, default_ms: float) -> float:
    """The step time a request's class holds its decode steps to: its ``tbt_slo_ms``, else (an
    interactive class with none set) ``default_ms``; 0 for flex work without one (no target)."""
    return limit(sampling, "tbt_slo_ms", cfg) or (0.0 if rank(sampling) == FLEX_RANK else default_ms)


def tightest_target_ms(samplings: Iterable[Any], cfg: Config, default_ms: float) -> float:
    """The tightest ``tbt_target_ms`` among ``samplings`` (0: none has one)."""
    return min((t for t in {tbt_target_ms(s, cfg, default_ms) for s in samplings} if t), default=0.0)


def limit(sampling: Any, key: str, cfg: Config) -> Any:
    """A request's class's ``key`` (``[classes.<class>]``, else ``[admission]``'s): ``ttft_slo_ms``,
    ``tbt_slo_ms`` (0: none), ``request_timeout_s`` (how long it may make no progress before it
    moves: flex work may wait behind the rest), ``max_waiting``."""
    return cfg.classes.limit(CLASSES[rank(sampling)], key, cfg.admission)

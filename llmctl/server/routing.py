"""Which engine answers a request: the primary model, or the fallback while the primary is loaded.

Owns the load signal (one number in [0, 1] from an engine's stats snapshot), the routing policy
with hysteresis (pure: `FallbackPolicy.update(load)` decides, tests drive it with numbers), and
`ModelRouter`, which picks the `OpenAIServing` of the chosen engine for each new request. A request
is routed once, before it is tokenised (the two models may have different tokenizers), and stays on
its engine until it finishes: in-flight requests never move. A burst is counted as it is routed:
the primary's snapshot is published after each engine step, so the router adds the requests it
sent there that no snapshot or engine queue shows yet (tokenising); each stops counting once its
engine has it.
"""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Callable, Generic, Optional, TypeVar

from llmctl.server.errors import APIError

DEFAULT_FALLBACK_AT = 0.8
DEFAULT_HYSTERESIS = 0.1

Target = TypeVar("Target")


def load_signal(stats: dict[str, float], admission_limit: Optional[int] = None, unseen: int = 0) -> float:
    """An engine's load in [0, 1]: the largest of three pressures, each 1 where more requests only queue.

    - KV-cache usage (blocks in use / all blocks): new sequences soon cannot be admitted or preempt others;
    - running requests / `max_num_seqs`: the batch is full, new requests wait;
    - waiting requests / the admission limit (`--max-waiting-requests`; without one, `max_num_seqs`):
      the queue a new request would join; `unseen` requests on their way to the engine join it too.
    """
    kv = float(stats.get("kv_cache_usage", 0.0))
    max_seqs = max(float(stats.get("max_num_seqs", 0) or 0), 1.0)
    running = float(stats.get("num_running_requests", 0)) / max_seqs
    waiting_now = float(stats.get("num_waiting_requests", 0)) + float(stats.get("num_pending", 0)) + unseen
    queue_room = float(admission_limit) if admission_limit else max_seqs
    waiting = waiting_now / queue_room if queue_room > 0 else (1.0 if waiting_now else 0.0)
    return min(max(kv, running, waiting, 0.0), 1.0)


@dataclass
class FallbackPolicy:
    """Degrade at `threshold`, recover below `threshold - hysteresis` (a load hovering at the
    threshold would otherwise flip the route on every request)."""
    threshold: float = DEFAULT_FALLBACK_AT
    hysteresis: float = DEFAULT_HYSTERESIS
    degraded: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < self.threshold <= 1.0:
            raise ValueError(f"--fallback-at must be in (0, 1], got {self.threshold}")
        if not 0.0 <= self.hysteresis < self.threshold:
            raise ValueError(f"--fallback-hysteresis must be in [0, --fallback-at), got {self.hysteresis}")

    def update(self, load: float) -> bool:
        """Feed the primary's current load; True while new requests should go to the fallback."""
        if self.degraded:
            self.degraded = load >= round(self.threshold - self.hysteresis, 9)  # 0.8 - 0.1 is 0.7000000000000001
        else:
            self.degraded = load >= self.threshold
        return self.degraded


class _Unseen:
    """Requests routed to the primary that its engine has not been handed yet: each is counted once,
    until `handed_over` (the engine took it) or `release` (its handler ended without submitting)."""

    def __init__(self) -> None:
        self.count = 0

    def ticket(self) -> "_Ticket":
        self.count += 1
        return _Ticket(self)


@dataclass
class _Ticket:
    unseen: _Unseen
    open: bool = True

    def release(self) -> None:
        if self.open:
            self.open = False
            self.unseen.count -= 1


@dataclass
class Route(Generic[Target]):
    target: Target
    model: str
    degraded: bool  # sent to the fallback because of load (not because the client asked for it)
    ticket: Optional[_Ticket] = field(default=None, repr=False)  # counted as unseen load until released

    def release(self) -> None:
        """The request's handler ended: it no longer waits to reach its engine, whatever happened."""
        if self.ticket is not None:
            self.ticket.release()


# The route of the request being handled in this task: the engine's submission listener finds it here.
_CURRENT_TICKET: ContextVar[Optional[_Ticket]] = ContextVar("llmctl_route_ticket", default=None)


class ModelRouter(Generic[Target]):
    """Routes by the request's `model`: the fallback's name goes to the fallback, the primary's name
    (or none) to the primary unless the policy says it is loaded; any other name is a 404."""

    def __init__(self, primary: tuple[str, Target], primary_load: Callable[[int], float],
                 fallback: Optional[tuple[str, Target]] = None, policy: Optional[FallbackPolicy] = None):
        """`primary_load(unseen)`: the primary's load signal from its latest snapshot with `unseen`
        more requests on their way (routed here, not yet in its engine)."""
        self.primary_name, self.primary = primary
        self.fallback_name, self.fallback = fallback if fallback is not None else (None, None)
        self.primary_load = primary_load
        self.policy = policy or FallbackPolicy()
        self.num_degraded = 0
        self._unseen = _Unseen()

    @property
    def num_unseen(self) -> int:
        """Requests routed to the primary that its engine does not have yet."""
        return self._unseen.count

    def handed_over(self) -> None:
        """The primary's engine took a request (its submission listener, on the request's task):
        from now its snapshot or queue counts it, so the router stops counting it."""
        ticket = _CURRENT_TICKET.get()
        if ticket is not None:
            ticket.release()

    @property
    def model_names(self) -> list[str]:
        return [self.primary_name] + ([self.fallback_name] if self.fallback_name is not None else [])

    def check_model(self, model: Optional[str]) -> None:
        """404 (OpenAI's `model_not_found`) unless `model` is None or a served name."""
        if model is not None and model not in self.model_names:
            served = " and ".join(f"'{name}'" for name in self.model_names)
            raise APIError(404, f"the model '{model}' does not exist; this server serves {served}",
                           param="model", code="model_not_found")

    def route(self, model: Optional[str], may_degrade: bool = True) -> Route[Target]:
        """`may_degrade=False` keeps a request for the primary there whatever the load (token-id
        prompts: their ids belong to the primary's vocabulary)."""
        self.check_model(model)
        if self.fallback_name is None:
            return Route(self.primary, self.primary_name, False)
        if model == self.fallback_name:
            return Route(self.fallback, self.fallback_name, False)
        if self.policy.update(self.primary_load(self.num_unseen)) and may_degrade:
            self.num_degraded += 1
            return Route(self.fallback, self.fallback_name, True)
        return self._to_primary()

    def _to_primary(self) -> Route[Target]:
        ticket = self._unseen.ticket()
        _CURRENT_TICKET.set(ticket)
        return Route(self.primary, self.primary_name, False, ticket)

    @property
    def degraded(self) -> bool:
        """Whether new requests for the primary go to the fallback now: the policy fed the current
        load (so the answer falls with the load, not only at the next request)."""
        return self.fallback_name is not None and self.policy.update(self.primary_load(self.num_unseen))

"""The connector's counters: what they are, and a plain record of them (no vLLM).

``COUNTERS`` names every counter; ``Counts`` is what a worker records into (the worker
role runs without vLLM); ``stats.py`` carries the same ``{name: {label value: count}}``
payload the way vLLM carries connector statistics.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class CounterSpec:
    name: str
    documentation: str
    label: str = ""  # the label's name; "" for a counter without one
    values: tuple[str, ...] = ("",)  # label values exported (at 0) from the start


# Refusal reasons: why the connector did not transfer a request.
BAD_PARAMS = "bad_kv_transfer_params"
ID_TOO_LONG = "request_id_too_long"
# Why held requests were released without their final event.
DAEMON_GONE = "daemon_gone"
DAEMON_RESTARTED = "daemon_restarted"
BACKSTOP = "backstop"
# How the push of a started layer-wise request that vLLM preempted ended.
FENCED = "fenced"
UNCONFIRMED = "unconfirmed"

COUNTERS: tuple[CounterSpec, ...] = (
    CounterSpec("refused_requests", "Requests the pushsvc connector did not transfer because of what the client "
                "sent: D prefilled them locally, P freed their blocks at once.", "reason", (BAD_PARAMS, ID_TOO_LONG)),
    CounterSpec("ignored_transfer_ids", "kv_transfer_params.transfer_id values that are no valid match key; the "
                "request went on without them."),
    CounterSpec("backstop_expiries", "Requests whose connector backstop (watchdog_s on D, lease_s on P) fired "
                "before the daemon reported them.", "side", ("recv", "send")),
    CounterSpec("daemon_disconnects", "Connections of a worker to its pushsvc daemon that were lost."),
    CounterSpec("held_requests", "Transfers outstanding when a worker lost its daemon connection, held until "
                "the daemon reports them or is known to be gone."),
    CounterSpec("released_requests", "Held transfers released without the daemon's final event: no daemon "
                "listening, a new daemon incarnation, or the connector's backstop.", "cause",
                (DAEMON_GONE, DAEMON_RESTARTED, BACKSTOP)),
    CounterSpec("preempted_pushes", "Layer-wise pushes whose request vLLM preempted after the step that ends its "
                "prefill was scheduled (its blocks back in vLLM's pool): fenced, the daemon confirmed before the "
                "next forward pass that it reads none of them; unconfirmed, it did not within the fence timeout.",
                "outcome", (FENCED, UNCONFIRMED)),
)
NAMES = frozenset(spec.name for spec in COUNTERS)


def record(data: dict[str, dict[str, int]], name: str, label: str = "", n: int = 1) -> None:
    by_label = data.setdefault(name, {})
    by_label[label] = by_label.get(label, 0) + n


def count(data: dict[str, dict[str, int]], name: str, label: str = "") -> int:
    return data.get(name, {}).get(label, 0)


def is_empty(data: dict[str, dict[str, int]]) -> bool:
    return not any(n for by_label in data.values() for n in by_label.values())


@dataclass
class Counts:
    """Counts since the last ``take``: ``data[name][label value]``."""

    data: dict[str, dict[str, int]] = field(default_factory=dict)

    def record(self, name: str, label: str = "", n: int = 1) -> None:
        record(self.data, name, label, n)

    def count(self, name: str, label: str = "") -> int:
        return count(self.data, name, label)

    def take(self) -> Counts | None:
        """What was recorded since the last call (None if nothing), and start afresh."""
        if is_empty(self.data):
            return None
        taken, self.data = Counts(self.data), {}
        return taken

    def to_dict(self) -> dict[str, dict[str, int]]:
        return self.data

"""doctor's UDP probe request: a second doctor within the coordinator's probe interval waits it out and gets
the answer (CI's doctor test ran doctor twice on one node within 2 s and got a 'skip')."""

from __future__ import annotations

import pytest

from meshrun.errors import CoordinatorError, UsageError
from meshrun.mesh import doctor
from meshrun.mesh.coordinator.overlay import PROBE_INTERVAL_S


class Coordinator:
    """Answers /v1/probe-udp as the overlay API does: 429 for the first `refusals` calls, then a probe."""

    def __init__(self, refusals: int, error=UsageError) -> None:
        self.refusals, self.error, self.calls = refusals, error, []

    def call(self, ip, port, method, path, body=None, **kw):
        self.calls.append((method, path))
        if len(self.calls) <= self.refusals:
            raise self.error("a UDP probe was sent to this node a moment ago", "wait 2 s", status=429)
        return {"endpoint": "198.51.100.7:51820", "sent": 3}


@pytest.fixture
def slept(monkeypatch):
    waits: list[float] = []
    monkeypatch.setattr(doctor.time, "sleep", waits.append)
    return waits


def test_a_probe_refused_as_too_soon_is_asked_again_after_the_interval(monkeypatch, slept):
    coord = Coordinator(refusals=1)
    monkeypatch.setattr(doctor.transport, "call", coord.call)
    assert doctor._ask_probe("10.99.0.1", 51821)["sent"] == 3
    assert coord.calls == [("POST", "/v1/probe-udp")] * 2
    assert slept and slept[0] >= PROBE_INTERVAL_S


def test_it_asks_again_only_once_and_other_errors_are_not_retried(monkeypatch, slept):
    twice = Coordinator(refusals=2)
    monkeypatch.setattr(doctor.transport, "call", twice.call)
    with pytest.raises(UsageError):
        doctor._ask_probe("10.99.0.1", 51821)
    assert len(twice.calls) == 2
    slept.clear()
    gone = Coordinator(refusals=1, error=lambda m, f, status: CoordinatorError(m, f, status=409))
    monkeypatch.setattr(doctor.transport, "call", gone.call)
    with pytest.raises(CoordinatorError):
        doctor._ask_probe("10.99.0.1", 51821)
    assert len(gone.calls) == 1 and not slept


def test_arrivals_are_counted_from_the_coordinator_asked_not_the_tokens_first():
    """The probe comes from the coordinator the agent syncs with: its endpoint as this node's WireGuard sees it
    (before, the token's first enrolment address, which after that coordinator's loss matched no datagram)."""
    asked = {"name": "dc2-a", "endpoint": "203.0.113.2:51820", "path": "direct"}
    assert doctor._public_endpoint(asked) == "203.0.113.2:51820"
    # A relayed coordinator's endpoint is the relay's: the token's address is the better guess then.
    assert doctor._public_endpoint(dict(asked, path="relayed")) is None
    assert doctor._public_endpoint(dict(asked, endpoint=None)) is None and doctor._public_endpoint(None) is None

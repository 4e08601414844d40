"""A joint's memory of gatherings that ended before every member registered (pure)."""

from __future__ import annotations

from pushsvc.server.joints import MAX_ENDED, Joint


def _joint(members: int = 2) -> Joint:
    return Joint(0, 1, "consumer", 0, agent=None, remotes=None, members=[object() for _ in range(members)])  # type: ignore[arg-type]


def test_a_member_that_registers_after_the_end_hears_it_once() -> None:
    joint = _joint(3)
    joint.end("r", now=0.0, reason="cancelled", told={0})
    assert joint.late("r", 0, now=1.0, keep_s=10) == "", "member 0 heard it already"
    assert joint.late("r", 1, now=1.0, keep_s=10) == "cancelled"
    assert joint.late("r", 1, now=1.0, keep_s=10) == "", "once per member"
    assert joint.late("r", 2, now=1.0, keep_s=10) == "cancelled"
    assert "r" not in joint.ended, "forgotten once every member heard"


def test_an_end_every_member_heard_is_not_kept_and_old_ends_expire() -> None:
    joint = _joint(2)
    joint.end("all", now=0.0, reason="x", told={0, 1})
    assert "all" not in joint.ended
    joint.end("old", now=0.0, reason="watchdog", told={0})
    assert joint.late("old", 1, now=10.0, keep_s=10) == "", "kept for keep_s only"
    assert joint.ended == {}


def test_ends_are_bounded() -> None:
    joint = _joint(2)
    for i in range(MAX_ENDED + 10):
        joint.end(f"r{i}", now=0.0, reason="cancelled", told={0})
    assert len(joint.ended) == MAX_ENDED and "r0" not in joint.ended and f"r{MAX_ENDED + 9}" in joint.ended

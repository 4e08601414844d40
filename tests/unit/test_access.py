"""Who the worker socket admits, and which unfinished connections give way: pure logic."""

from __future__ import annotations

import pytest

from pushsvc.server.access import AccessPolicy, PendingQueue

OWN = 1234


def policy(uids=(), gids=(), socket_gid=None) -> AccessPolicy:
    return AccessPolicy.build(own_uid=OWN, allowed_uids=uids, allowed_gids=gids, socket_gid=socket_gid)


@pytest.mark.parametrize(("uid", "groups", "admitted"), [
    (0, set(), True),  # root
    (OWN, set(), True),  # the daemon's own uid
    (5000, {5000}, False),
    (64000, {64001}, True),  # listed uid
    (64001, {64200}, True),  # listed gid as primary or supplementary group
    (64001, {64001, 64100}, False),  # the socket's group no longer counts once gids are listed
])
def test_explicit_lists(uid: int, groups: set[int], admitted: bool) -> None:
    assert policy(uids=[64000], gids=[64200], socket_gid=64100).admits(uid, groups) is admitted


def test_socket_group_is_the_allowed_gid_when_none_are_listed() -> None:
    p = policy(socket_gid=64100)
    assert p.admits(64001, {64001, 64100})
    assert not p.admits(64001, {64001})


def test_without_lists_or_group_only_root_and_self() -> None:
    p = policy()
    assert p.admits(0, set()) and p.admits(OWN, set())
    assert not p.admits(OWN + 1, {0, OWN})  # groups alone admit nothing when no gid is listed


def test_pending_queue_orders_caps_and_expires() -> None:
    q: PendingQueue[str] = PendingQueue(cap=2, timeout_s=5.0)
    assert q.add("a", now=0.0) == 5.0
    q.add("b", now=1.0)
    assert not q.over_cap()
    q.add("c", now=2.0)
    assert q.over_cap() and q.oldest() == "a"
    q.discard("a")
    assert not q.over_cap() and q.oldest() == "b"
    assert q.expired(now=5.9) == []
    assert q.expired(now=6.0) == ["b"]
    assert q.expired(now=100.0) == ["b", "c"]
    assert q.next_deadline() == 6.0
    q.discard("b")
    q.discard("b")  # idempotent
    q.discard("c")
    assert len(q) == 0 and q.oldest() is None and q.next_deadline() is None

"""The worker's reconnect policy (worker/reconnect.py): the next replica at once, then a jittered
backoff capped at a few seconds, and afresh after a healthy session."""

from __future__ import annotations

import random

from worker.reconnect import ReconnectPolicy


def _policy(replicas: int, **kw: float) -> ReconnectPolicy:
    return ReconnectPolicy(replicas=replicas, rng=random.Random(0), **kw)


def test_one_replica_backs_off_doubling_and_capped() -> None:
    policy = _policy(1, first_s=0.5, max_s=5.0)
    waits = [policy.wait_s(failed=True, connected_s=None) for _ in range(8)]
    # jittered within [0.5, 1.5) of 0.5, 1, 2, 4, 5, 5, ...; never above the cap
    for wait, base in zip(waits, [0.5, 1, 2, 4, 5, 5, 5, 5], strict=True):
        assert 0.5 * base <= wait < 1.5 * base and wait <= 5.0


def test_a_healthy_session_starts_the_next_outage_afresh() -> None:
    policy = _policy(1, first_s=0.5, max_s=5.0, healthy_s=10.0)
    for _ in range(6):
        policy.wait_s(failed=True, connected_s=None)  # a long outage: at the cap now
    assert policy.wait_s(failed=True, connected_s=3.0) >= 2.5  # up briefly: still the same outage
    assert policy.wait_s(failed=True, connected_s=60.0) < 0.75  # up for a minute: a new outage


def test_the_other_replicas_are_tried_at_once() -> None:
    policy = _policy(3)
    assert policy.wait_s(failed=True, connected_s=60.0) == 0.0  # replica 2 now
    assert policy.wait_s(failed=True, connected_s=None) == 0.0  # replica 3 now
    assert 0.25 <= policy.wait_s(failed=True, connected_s=None) < 0.75  # all three failed: wait
    assert policy.wait_s(failed=True, connected_s=None) == 0.0  # the next round tries each again


def test_a_clean_close_reconnects_soon() -> None:
    policy = _policy(1)
    for _ in range(6):
        policy.wait_s(failed=True, connected_s=None)
    assert policy.wait_s(failed=False, connected_s=1.0) < 0.75

"""tokentrail: the ``tokentrail`` command line, the process launcher for ``up`` and ``demo``, and
``tokentrail.rollouts``, an iterator over a server's finished rollouts (``GET /v1/rollouts``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokentrail.feed import RolloutFeed


def rollouts(urls: str | Sequence[str], api_key: str, after: str | None = None, **options: Any) -> RolloutFeed:
    """Finished rollouts from a tokentrail server, resumable from ``after`` (see ``tokentrail.feed.RolloutFeed``
    for the options: schema, follow, model, min_version, ...).

        feed = tokentrail.rollouts("http://localhost:8080", key, after=saved_cursor)
        for rollout in feed:
            train_on(rollout)
            saved_cursor = feed.cursor  # store it with the training state
    """
    from tokentrail.feed import RolloutFeed

    return RolloutFeed(urls, api_key, after, **options)


__all__ = ["rollouts"]

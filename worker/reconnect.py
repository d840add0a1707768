"""When a worker reconnects after its session ended: the reconnect policy, apart from the socket code.

A service that expects restarts: the first failure of a healthy session moves to the next listed
replica at once; only once every replica failed does the worker wait, jittered, doubling while they
stay down and capped at a few seconds. A session that had been up for ``healthy_s`` starts the next
outage afresh, so one outage's backoff never carries into the next (a replica restarted twice must
not find its workers waiting longer each time).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field


@dataclass
class ReconnectPolicy:
    replicas: int
    first_s: float = 0.5
    max_s: float = 5.0
    healthy_s: float = 10.0
    rng: random.Random = field(default_factory=random.Random)
    _delay: float = field(init=False)
    _failures: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self._delay = self.first_s

    def wait_s(self, *, failed: bool, connected_s: float | None) -> float:
        """Seconds to wait before connecting to the next replica (0: at once).

        ``failed``: the session ended with a connection error (not a clean close by the server);
        ``connected_s``: how long it had been connected (``None``: it never was)."""
        if not failed or (connected_s is not None and connected_s >= self.healthy_s):
            self._delay, self._failures = self.first_s, 0
        if failed:
            self._failures += 1
            if self._failures % max(1, self.replicas):
                return 0.0  # another replica has not been tried in this outage yet
        wait = self._delay * (0.5 + self.rng.random())
        if failed:
            self._delay = min(self._delay * 2, self.max_s)
        return min(wait, self.max_s)

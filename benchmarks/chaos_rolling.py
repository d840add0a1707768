"""The rolling restart of ``benchmarks/chaos.py`` (``--rolling N``) and the token gaps it causes.

After the chaos phase, while the users go on chatting, every replica in turn is stopped gracefully
(SIGTERM; SIGKILL if it is not gone after ``STOP_TIMEOUT_S``), started again and awaited until it
answers ``/health``; then the next one. ``N`` rounds of that.

``GapWatch`` times the readers' tokens: for every message whose reader was waiting for a token while a
rolling restart ran, the longest gap between two consecutive tokens it received (a reader that
reconnects, or an OpenAI stream that is asked again, counts as the same reader), and how long messages
asked for meanwhile waited for their first token. A reader still waiting at the end counts with the gap
so far. The goal (issue: rolling restarts): no message waits more than ``GAP_GOAL_S`` for its next token.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

from benchmarks.progress import say
from tokentrail.launcher import answers

GAP_GOAL_S = 5.0
STOP_TIMEOUT_S = 60.0
HEALTH_TIMEOUT_S = 60.0


@dataclass
class GapWatch:
    windows: list[list[float]] = field(default_factory=list)  # [start, end]; end inf while it runs
    max_gap: dict[str, float] = field(default_factory=dict)  # message -> longest token gap in a window
    first_wait: dict[str, float] = field(default_factory=dict)  # message asked for in a window -> s
    given_up: dict[str, float] = field(default_factory=dict)  # abandoned in a window -> its last token

    def begin(self) -> None:
        self.windows.append([time.monotonic(), float("inf")])

    def end(self) -> None:
        self.windows[-1][1] = time.monotonic()

    def _overlaps(self, a: float, b: float) -> bool:
        return any(a <= end and b >= start for start, end in self.windows)

    def token(self, mid: str, prev: float | None, now: float, asked: float | None) -> None:
        """A token of ``mid`` at ``now``; ``prev``: its previous token's time (None: the first), ``asked``:
        when it was asked for."""
        if prev is None:
            if asked is not None and self._overlaps(asked, now):
                self.first_wait[mid] = now - asked
        elif self._overlaps(prev, now):
            self.max_gap[mid] = max(self.max_gap.get(mid, 0.0), now - prev)

    def give_up(self, mid: str, last: float) -> None:
        """``mid``'s reader stopped waiting for its next token (its last at ``last``): if that was
        during a rolling restart, it never got it: its gap lasts to the end."""
        if self._overlaps(last, time.monotonic()):
            self.given_up[mid] = last

    def report(self, waiting: dict[str, float]) -> dict[str, Any]:
        """``waiting``: messages whose readers still wait for their next token -> time of their last one."""
        if not self.windows:
            return {}
        now = time.monotonic()
        for mid, last in {**waiting, **self.given_up}.items():
            self.token(mid, last, now, None)
        gaps = self.max_gap.values()
        return {
            "rolling_restart_s": [round(end - start, 1) for start, end in self.windows],
            "rolling_messages_streaming": len(self.max_gap),
            "rolling_max_token_gap_s": round(max(gaps), 3) if gaps else None,
            "rolling_messages_over_5s": sum(g > GAP_GOAL_S for g in gaps),
            "rolling_max_first_token_s": round(max(self.first_wait.values()), 3) if self.first_wait else None,
        }


async def rolling_restarts(c: Any, gaps: GapWatch, rounds: int, log: list[str], start: float) -> None:
    """``rounds`` rolling restarts of ``c``'s replicas (``c``: chaos.Cluster; ``start``: the run's start,
    for the log)."""
    for r in range(rounds):
        gaps.begin()
        for proc, url in zip(c.replicas, c.urls, strict=True):
            began = time.monotonic()
            stopped_in, forced = await asyncio.to_thread(proc.terminate, STOP_TIMEOUT_S)
            proc.start()
            deadline = time.monotonic() + HEALTH_TIMEOUT_S
            for _ in range(int(HEALTH_TIMEOUT_S * 10)):
                if await asyncio.to_thread(answers, url) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.1)
            healthy = time.monotonic() - began
            log.append(
                f"{began - start:6.1f}s rolling {r + 1}: {proc.name} stopped in {stopped_in:.1f}s"
                f"{' (SIGKILLed: SIGTERM was not enough)' if forced else ''}, healthy {healthy:.1f}s after SIGTERM"
            )
            say(log[-1])
        gaps.end()

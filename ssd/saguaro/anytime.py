"""The draft's branch budget, fitted to the time the target leaves it.

SSD's draft builds the next speculations while the target verifies; the
build is worth most when it ends just as the outcome arrives. A static plan
guesses that length once; this controller follows it round by round from two
things the draft sees for itself:
- a cut: the outcome arrived mid-build (the build stopped there and answered
  from the shorter branches it had, ssd.saguaro.builder.build_caches `stop`)
  or before the build ended: the budget was too large, so it shrinks by one;
- slack: the build ended and the draft then waited for the outcome; when
  the wait is longer than one more branch's share of the build, the budget
  grows by one.
It moves within [planned / 2, ceiling] (the planned budget: the start-up
plan's or the config's): a draft slower than the verification whatever its
budget (a small target, a busy core) keeps half its planned branches, since
fewer would only trade the target's wait for misses. Pure Python, no model
and no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass
class AnytimeBudget:
    """A learnt offset to every row's planned branch budget (the plan's or
    the config's), within [floor, ceiling] (the ceiling: the room the draft
    holds for a row's branches). One per draft: its rows share its time."""

    ceiling: int
    floor: int = 1
    extra: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.floor <= self.ceiling:
            raise ValueError(f"need 1 <= floor <= ceiling, got {self.floor}, {self.ceiling}")

    def budget(self, planned: int) -> int:
        """A row's branches for the next build."""
        return min(max(planned + self.extra, self._lowest(planned)), self.ceiling)

    def _lowest(self, planned: int) -> int:
        return min(max(self.floor, (planned + 1) // 2), self.ceiling)

    def observe(self, planned: int, cut: bool, build_s: float, wait_s: float) -> None:
        """One build of `budget(planned)` branches: cut (or overran), or ended
        `wait_s` seconds before the outcome arrived."""
        current = self.budget(planned)
        if cut:
            target = max(self._lowest(planned), current - 1)
        elif build_s > 0 and wait_s > build_s / (current + 1):  # room for one more branch
            target = min(self.ceiling, current + 1)
        else:
            return
        self.extra = target - planned

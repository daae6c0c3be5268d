"""The numbers of the bench report: table cells, ratios over paired rounds, and the targets."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import TypeVar

from bench.measure import Measure

# The targets of the service against the bare-Flask floor (issue 9): reads, and writes or mixed.
READ_TARGET, WRITE_TARGET = 0.85, 0.8
T = TypeVar("T")


def rotation(servers: list[T], number: int) -> list[T]:
    """The order of the servers in round `number`: shifted by one each round, so that no server
    always runs first on a scenario (after the pets of a write scenario were deleted) or last."""
    shift = number % len(servers) if servers else 0
    return servers[shift:] + servers[:shift]


def fmt(value: float | None, digits: int = 0) -> str:
    """A number for a table cell; n/a for None."""
    return "n/a" if value is None else f"{value:,.{digits}f}"


@dataclass(frozen=True)
class Ratio:
    """A ratio of requests/s over rounds: min, median, max, and the medians of each half."""

    values: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.values)

    def halves(self) -> tuple[float, float] | None:
        """Medians of the first and the second half of the rounds (None with fewer than 2)."""
        half = len(self.values) // 2
        if not half:
            return None
        return statistics.median(self.values[:half]), statistics.median(self.values[half:])

    def moved(self) -> float | None:
        """How far the two halves' medians are apart, as a share of the median."""
        halves = self.halves()
        return abs(halves[0] - halves[1]) / self.median if halves and self.median else None

    def cell(self) -> str:
        """'**median** (min–max)'."""
        return f"**{self.median:.2f}** ({min(self.values):.2f}–{max(self.values):.2f})"

    def halves_cell(self) -> str:
        """'h1 / h2 (moved %)'."""
        halves, moved = self.halves(), self.moved()
        if halves is None or moved is None:
            return "n/a"
        return f"{halves[0]:.2f} / {halves[1]:.2f} ({moved:.0%})"


def ratio(ours: list[Measure], base: list[Measure]) -> Ratio | None:
    """Round by round, ours' requests/s over base's (rounds ran side by side)."""
    values = [a.rps / b.rps for a, b in zip(ours, base, strict=False) if b.rps]
    return Ratio(values) if values else None


def cpu_ratio(ours: list[Measure], base: list[Measure]) -> Ratio | None:
    """Round by round, base's app CPU per request over ours': what the ratio of requests/s
    would be if both were bound by their own CPU alone (steadier under background load)."""
    values = [
        b.app_us / a.app_us
        for a, b in zip(ours, base, strict=False)
        if a.app_us and b.app_us is not None
    ]
    return Ratio(values) if values else None


def target_of(scenario: str) -> float:
    """The target ratio against the bare-Flask floor: 0.8 for writes and mixed, else 0.85."""
    return WRITE_TARGET if scenario.startswith(("POST", "mixed")) else READ_TARGET

"""Reads on standbys kept fresh: a client that creates a pet, then polls the listing for it."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from tests.support.checks import Answer, call

# The read pools' lag bound (PETSTORE_READ_MAX_LAG_SECONDS, its default) and reliability 5's: every
# listing made this long after a pet's 201 holds that pet.
READ_MAX_LAG = 1.0
FRESH_WITHIN = READ_MAX_LAG + 1.0


@dataclass
class Probe:
    """One sold pet created, then the filtered listing polled for it."""

    pet_id: int
    created_at: float  # monotonic, when its 201 came
    # (seconds from the 201 to each listing's start, whether it held the pet), 200s only.
    listings: list[tuple[float, bool]]

    def stale(self) -> list[float]:
        """The listings made past FRESH_WITHIN that lacked the pet (seconds after the 201)."""
        return [after for after, held in self.listings if after > FRESH_WITHIN and not held]

    def latest_miss(self) -> float:
        return max((after for after, held in self.listings if not held), default=0.0)


class FreshReads:
    """A thread creating sold pets (each Idempotency-Key retried on 503 or no answer) and listing
    the sold pets from each one on, every 0.1 s for FRESH_WITHIN + 0.5 s, until stopped.

    Any answer but 200, 201 and 503 is kept in `unexpected`.
    """

    def __init__(self, base_url: str, key: str) -> None:
        self.base_url = base_url
        self.headers = {"Authorization": f"Bearer {key}"}
        self.probes: list[Probe] = []
        self.unexpected: list[str] = []

    def send(self, method: str, path: str, **extra: Any) -> Answer | None:
        """The answer, or None when there was none (a worker killed, a connection reset)."""
        headers = {**self.headers, **extra.pop("headers", {})}
        try:
            answer = call(self.base_url, method, path, headers=headers, **extra)
        except OSError:
            time.sleep(0.2)
            return None
        if answer.status not in (200, 201, 503):
            self.unexpected.append(f"{method} {path}: {answer.status} {answer.body}")
        return answer

    def create(self, number: int, stop: threading.Event) -> int | None:
        pet = {"name": f"fresh-{number}", "categoryId": 7, "status": "sold"}
        idempotency = {"Idempotency-Key": f"fresh-reads-{os.getpid()}-{id(self)}-{number}"}
        while not stop.is_set():
            sent = self.send("POST", "/v1/pets", headers=idempotency, json_body=pet)
            if sent is not None and sent.status == 201:
                return int(sent.body["id"])
            if sent is not None and sent.status != 503:
                return None
            time.sleep(0.2)
        return None

    def run(self, stop: threading.Event) -> None:
        number = 0
        while not stop.is_set():
            number += 1
            pet_id = self.create(number, stop)
            if pet_id is None:
                continue
            probe = Probe(pet_id, time.monotonic(), [])
            self.probes.append(probe)
            path = f"/v1/pets?status=sold&after={pet_id - 1}&limit=1"
            while time.monotonic() - probe.created_at < FRESH_WITHIN + 0.5:
                started = time.monotonic() - probe.created_at
                listed = self.send("GET", path)
                if listed is not None and listed.status == 200:
                    held = [pet["id"] for pet in listed.body] == [pet_id]
                    probe.listings.append((started, held))
                time.sleep(0.1)

    @contextmanager
    def running(self) -> Iterator[FreshReads]:
        """`run` in a thread through the with block; stopped and waited for (30 s) at its end."""
        stop = threading.Event()
        client = threading.Thread(target=self.run, args=(stop,), daemon=True)
        client.start()
        try:
            yield self
        finally:
            stop.set()
            client.join(timeout=30)
        assert not client.is_alive(), "the read probe did not stop within 30 s"

    def between(self, start: float, end: float) -> list[Probe]:
        """The probes whose 201 came between two monotonic times."""
        return [probe for probe in self.probes if start <= probe.created_at <= end]

    def stale(self) -> list[tuple[int, list[float]]]:
        """(pet id, its stale listings) of each probe with one."""
        return [(probe.pet_id, probe.stale()) for probe in self.probes if probe.stale()]

    def summary(self, probes: list[Probe] | None = None) -> str:
        chosen = self.probes if probes is None else probes
        listings = sum(len(probe.listings) for probe in chosen)
        worst = max((probe.latest_miss() for probe in chosen), default=0.0)
        stale = [probe for probe in chosen if probe.stale()]
        return (
            f"{len(chosen)} pets created, {listings} listings, the latest miss {worst:.2f} s "
            f"after its 201, {len(stale)} pets with a listing staler than {FRESH_WITHIN:g} s"
        )

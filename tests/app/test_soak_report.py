"""The report of `make soak` (bench/soak.py), from answers made up here, without running the soak."""

from __future__ import annotations

import argparse

from requests.structures import CaseInsensitiveDict

from bench.soak import Run, SoakLoad, percentile, report
from tests.support.checks import Answer
from tests.support.freshness import FreshReads, Probe

MINUTES = 2.0
FAULT_EVERY = 1.0


def answer(status: int, started: float, elapsed: float) -> Answer:
    return Answer("GET", "/v1/pets", status, None, CaseInsensitiveDict(), elapsed, started)


def made_up_run(rss_end: dict[int, int]) -> Run:
    """Two slices of a minute: 100 answers of 10..109 ms in the first, a 503 and a 502 in the second."""
    args = argparse.Namespace(minutes=MINUTES, fault_every=FAULT_EVERY, clients=8)
    load = SoakLoad("http://127.0.0.1:1", "key", "soak")
    load.answers = [answer(200, 1000.0 + n / 10, (10 + n) / 1000) for n in range(100)]
    load.answers += [answer(503, 1070.0, 1.0), answer(502, 1080.0, 0.05)]
    load.created = [1, 2, 3]
    reads = FreshReads("http://127.0.0.1:1", "key")
    # A pet listed at once and later in the first slice; one missing 2.3 s after its 201.
    reads.probes = [Probe(7, 1010.0, [(0.0, True), (2.1, True)]), Probe(8, 1075.0, [(2.3, False)])]
    return Run(
        args,
        started=1000.0,
        ended=1000.0 + MINUTES * 60,
        rss_start={11: 50 * 1024, 12: 50 * 1024, 13: 50 * 1024},
        rss_end=rss_end,
        load=load,
        reads=reads,
        faults=[(30.0, "Redis restart", 0.2, "killed and started again, empty")],
        rows=3,
        rows_of_201s=2,
        probe_rows=2,
    )


def test_nearest_rank_percentiles() -> None:
    values = [float(n) for n in range(1, 101)]
    assert percentile(values, 0.5) == 51.0
    assert percentile(values, 0.99) == 100.0
    assert percentile([], 0.99) == 0.0


def test_each_slice_has_its_fault_latency_and_statuses() -> None:
    text = report(made_up_run({11: 51 * 1024, 12: 60 * 1024, 14: 50 * 1024}))
    assert "| 0-1 min | Redis restart | 100 | 60.0 | 109.0 | 109 | 100 | 0 | 0 | 0 |" in text
    assert "| 1-2 min |  | 2 | 1000.0 | 1000.0 | 1000 | 0 | 0 | 1 | 1 |" in text
    assert "| 30 | Redis restart | 0.2 | killed and started again, empty |" in text
    assert "102 answers: 2xx 100, 503 1, 5xx 1 (each status: 200 100, 502 1, 503 1)" in text


def test_rows_against_the_201s_and_worker_rss() -> None:
    text = report(made_up_run({11: 51 * 1024, 12: 60 * 1024, 14: 50 * 1024}))
    assert "3 201s answered (3 distinct ids); 2 of those ids are rows" in text
    assert "| 11 | 50.0 | 51.0 | +2.0% | yes |" in text
    assert "| 12 | 50.0 | 60.0 | +20.0% | NO |" in text
    assert "Killed: 13 (50.0 MB); started in their place: 14 (50.0 MB)." in text


def test_read_freshness_in_all_and_per_slice() -> None:
    text = report(made_up_run({11: 51 * 1024}))
    assert "Stale reads: 1. In all: 2 pets created, 3 listings, the latest miss 2.30 s" in text
    assert "2 of the 2 probe pets are rows on the primary at the end." in text
    assert (
        "| 0 min | Redis restart | 1 pets created, 2 listings, the latest miss 0.00 s after its "
        "201, 0 pets with a listing staler than 2 s |"
    ) in text
    assert "| 1 min |  | 1 pets created, 1 listings, the latest miss 2.30 s" in text

"""The report of `make bench` (bench/report.py) and its CPU accounting (bench/measure.py), without
running the benchmark: the production path first, every section from its own function, and the
CPU per request of each process it names."""

from __future__ import annotations

import dataclasses
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from bench.measure import Measure, cpu_seconds, process_tree
from bench.numbers import ratio, rotation
from bench.report import (
    Run,
    against_baseline,
    against_previous,
    cpu_table,
    headline_ratios,
    render,
)
from bench.run import parse_args
from bench.servers import FLASK_FLOOR, RAW_FLOOR, SERVICE, Server
from bench.studies.profile import folded_stacks, top_frames
from tests.support.servers import poll_until

SCENARIO = "GET /v1/pets/{id}"
PRODUCTION = tuple(
    Server(app, "redis", 5, threads=1, worker_class="sync", nginx=True)
    for app in (SERVICE, FLASK_FLOOR, RAW_FLOOR)
)
DIRECT = tuple(
    Server(app, "redis", 5, threads=1, worker_class="sync")
    for app in (SERVICE, FLASK_FLOOR, RAW_FLOOR)
)
FACTS = {
    "commit": "abc1234",
    "cpu": "a CPU",
    "cores": "2",
    "memory": "4 GiB",
    "postgres": "PostgreSQL 15",
    "python": "Python 3.11",
    "wrk": "wrk 4.1.0",
    "database": "",
}
SETTINGS = {
    "threads": "1",
    "connections": "8",
    "rounds": "2",
    "config_rounds": "1",
    "duration": "1",
    "warmup": "1",
    "invocation": ".venv/bin/python -m bench.run",
    "size_service": "service",
    "size_floor": "raw floor",
}


def measure(requests: int, app_cpu: float, nginx_cpu: float | None = None) -> Measure:
    """One second of wrk: `requests` answered, the CPU seconds each process spent."""
    return Measure(
        requests=requests,
        seconds=1.0,
        p50_ms=2.0,
        p99_ms=9.0,
        errors=0,
        app_cpu=app_cpu,
        pg_cpu=0.2,
        wrk_cpu=0.1,
        other_cpu=0.0,
        redis_cpu=0.05,
        nginx_cpu=nginx_cpu,
        machine_cpu=1.5,
    )


def a_run() -> Run:
    """Two rounds of the production path and one of the direct group, at 10,000 pets."""
    run = Run(sizes=[10_000], scenario_names=[SCENARIO], pages={10_000: 250})
    run.groups = [("production path: nginx, redis://", PRODUCTION), ("redis:// direct", DIRECT)]
    for server, requests in zip(PRODUCTION, (1000, 1250, 2000), strict=True):
        run.rounds[(10_000, server.label, SCENARIO)] = [measure(requests, 1.0, 0.1)] * 2
    for server, requests in zip(DIRECT, (1100, 1300, 2100), strict=True):
        run.rounds[(10_000, server.label, SCENARIO)] = [measure(requests, 1.0)]
    run.configs[(SCENARIO, PRODUCTION[0].label)] = [measure(1000, 1.0, 0.1)]
    run.notes.append("a note")
    return run


def test_the_production_path_is_the_headline_and_each_section_follows() -> None:
    text = render(a_run(), FACTS, SETTINGS, 60.0, [])

    headings = [line for line in text.splitlines() if line.startswith("## ")]
    assert headings[:2] == ["## production path: nginx, redis://", "## redis:// direct"]
    assert headings[2:] == [
        "## CPU per request",
        "## Serving configurations (the service on redis://, through nginx)",
        "## Notes",
        "## Commands",
    ]
    assert "deploy/nginx/petstore.conf" in text
    # service ÷ bare-Flask floor: 1,000 ÷ 1,250 requests/s in each round.
    assert f"| 10,000 | {SCENARIO} | 1,000 | 1,250 | 2,000 | **0.80** (0.80–0.80) |" in text


def test_the_cpu_table_has_every_process_per_request() -> None:
    lines = cpu_table(a_run(), PRODUCTION)

    assert "nginx µs" in lines[0] and "whole machine µs" in lines[0]
    service, flask_floor = lines[2], lines[3]
    # 1 s of app CPU over 2,000 requests; PostgreSQL 0.4, Redis 0.1, nginx 0.2 and the machine
    # 3 s of CPU over the same requests.
    assert service.startswith(f"| 10,000 | {SCENARIO} | service | 1,000 | 200 | 50 | 100 | 1,500 |")
    # The floor answered 2,500 requests with the same CPU: the service spent 1.25× its CPU.
    assert f"| {FLASK_FLOOR} | 800 | 160 | 40 | 80 | 1,200 | **1.25** (1.25–1.25) | 1.25 |" in (
        flask_floor
    )


def test_the_direct_group_has_no_nginx_column_value() -> None:
    lines = cpu_table(a_run(), DIRECT)

    assert "| service | 909 | 182 | 45 | n/a | 1,364 |" in lines[2]


def test_the_next_report_compares_its_headline_ratios_with_this_one(tmp_path: Path) -> None:
    previous = tmp_path / "previous.md"
    previous.write_text(render(a_run(), FACTS, SETTINGS, 60.0, []))

    ratios = headline_ratios(previous.read_text())
    assert ratios[("production", "10,000", SCENARIO)] == 0.8
    assert "moved by 0.0%" in against_previous(previous.read_text(), previous)


def test_a_process_tree_counts_the_children_and_their_cpu() -> None:
    """A parent whose child burns 0.3 s of CPU, then sleeps: the tree has both, and the CPU."""
    burn = "import time\nend = time.process_time() + 0.3\nwhile time.process_time() < end: pass\n"
    burn += "time.sleep(60)"
    code = (
        "import subprocess, sys\n"
        f"child = subprocess.Popen([sys.executable, '-c', {burn!r}])\n"
        "print(child.pid, flush=True)\n"
        "sys.stdin.read()\n"
        "child.kill()\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        assert process_tree(parent.pid) == [parent.pid, child]
        spent = poll_until(lambda: cpu_seconds([child]), lambda cpu: cpu >= 0.25, 30.0)
        assert spent >= 0.25
    finally:
        parent.communicate("", timeout=30)


def paced(requests: list[int]) -> list[Measure]:
    """One Measure per round, with these requests in 1 s and 1 s of app CPU each."""
    return [measure(each, 1.0, 0.1) for each in requests]


def test_paired_rounds_hold_a_ratio_that_drift_moves_between_unpaired_medians() -> None:
    """The machine's throughput drifts (990 to 1,440 requests/s for the same server, as in
    issue 31) and the service does 0.8× its floor's work at every moment: each round's pair ran
    at one moment, so every paired ratio is 0.8; medians of rounds run at other moments are not."""
    moments = [990, 1100, 1200, 1300, 1440]  # what the floor does at each moment
    service = paced([round(0.8 * each) for each in moments])

    paired = ratio(service, paced(moments))

    assert paired is not None
    assert paired.cell() == "**0.80** (0.80–0.80)"
    # The floor's rounds measured at the fast moments, the service's at the slow ones.
    unpaired = statistics.median(round(0.8 * each) for each in [990, 990, 1100, 1100, 1200])
    unpaired /= statistics.median([1200, 1300, 1300, 1440, 1440])
    assert unpaired == pytest.approx(0.68, abs=0.005)


def test_the_paired_ratio_is_the_median_of_the_rounds_ratios_with_their_spread() -> None:
    found = ratio(paced([900, 1000, 1100, 800, 1000]), paced([1000, 1000, 1000, 1000, 800]))

    assert found is not None
    assert found.values == [0.9, 1.0, 1.1, 0.8, 1.25]
    assert found.cell() == "**1.00** (0.80–1.25)"
    assert found.halves_cell() == "0.95 / 1.10 (15%)"


def test_each_round_rotates_which_server_runs_first() -> None:
    servers = ["service", "Flask floor", "raw floor", "baseline"]

    orders = [rotation(servers, number) for number in range(5)]

    assert [order[0] for order in orders] == [*servers, "service"]
    assert all(sorted(order) == sorted(servers) for order in orders)
    assert rotation(servers, 1) == ["Flask floor", "raw floor", "baseline", "service"]


def test_the_bench_refuses_fewer_than_five_paired_rounds(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.run", "--rounds", "4"])
    with pytest.raises(SystemExit):
        parse_args()
    assert "--rounds: at least 5" in capsys.readouterr().err

    monkeypatch.setattr(sys, "argv", ["bench.run", "--rounds", "5", "--baseline", "abc1234"])
    assert parse_args().baseline == "abc1234"


def test_the_service_is_reported_against_its_baseline_build_from_the_same_rounds() -> None:
    baseline = dataclasses.replace(PRODUCTION[0], commit="abc1234")
    servers = (*PRODUCTION, baseline)
    run = Run(sizes=[10_000], scenario_names=["POST /v1/pets"], pages={10_000: 250})
    run.groups = [("production path: nginx, redis://", servers)]
    # The service answers 1,100 then 900 requests with 0.8 s of app CPU; the baseline 1,000
    # with 1.0 s: app CPU per request 727 then 889 µs against 1,000.
    run.rounds[(10_000, servers[0].label, "POST /v1/pets")] = [
        measure(1100, 0.8, 0.1),
        measure(900, 0.8, 0.1),
    ]
    for server in servers[1:]:
        run.rounds[(10_000, server.label, "POST /v1/pets")] = paced([1000, 1000])

    lines = against_baseline(run, servers)
    text = render(run, FACTS, SETTINGS, 60.0, [])

    assert f"**{baseline.label}**" in lines[0]
    row = next(line for line in lines if line.startswith("| 10,000 | POST"))
    assert row.startswith("| 10,000 | POST /v1/pets | 1,000 | 1,000 | **1.00** (0.90–1.10) | 800 ")
    assert "| 1,000 | **0.81** (0.73–0.89) | 9.0 / 9.0 |" in row
    assert row in text
    assert "| service @abc1234 | 1,000 |" in text  # its own row in the CPU table
    # The floors' table keeps three servers: the baseline has its own.
    assert "| 10,000 | POST /v1/pets | 1,000 | 1,000 | 1,000 | **1.00** (0.90–1.10) |" in text


def test_a_profile_gives_each_frame_its_own_and_its_inclusive_share() -> None:
    lines = [
        'process 1:"gunicorn";SyncWorker.handle (gunicorn/workers/sync.py);view (a.py) 6',
        'process 1:"gunicorn";SyncWorker.handle (gunicorn/workers/sync.py);view (a.py);load (b.py) 3',
        'process 1:"gunicorn";SyncWorker.handle (gunicorn/workers/sync.py);log (c.py) 1',
        "not a stack line",
    ]

    samples, own, inclusive = top_frames(folded_stacks(lines), top=3)

    assert samples == 10
    assert own == [("view (a.py)", 0.6), ("load (b.py)", 0.3), ("log (c.py)", 0.1)]
    assert inclusive == [
        ("SyncWorker.handle (gunicorn/workers/sync.py)", 1.0),
        ("view (a.py)", 0.9),
        ("load (b.py)", 0.3),
    ]


def test_the_same_service_on_two_table_sizes_has_its_own_section() -> None:
    small, large = (dataclasses.replace(PRODUCTION[0], pets=size) for size in (10_000, 1_000_000))
    run = a_run()
    run.size_pair = (small, large)
    # 1,000 requests/s at 10,000 pets, 800 at 1,000,000, the same app CPU per round.
    run.rounds[(10_000, small.label, SCENARIO)] = paced([1000] * 5)
    run.rounds[(10_000, large.label, SCENARIO)] = paced([800] * 5)

    text = render(run, FACTS, SETTINGS, 60.0, [])

    assert "## The same service at 10,000 and 1,000,000 pets (production path)" in text
    assert f"**{large.label}**" in text and large.label.endswith(" at 1,000,000 pets")
    assert f"| 10,000 | {SCENARIO} | 1,000 | 800 | **1.25** (1.25–1.25) |" in text

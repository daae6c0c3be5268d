"""The report of `make bench` (bench/report.py) and its CPU accounting (bench/measure.py), without
running the benchmark: the production path first, every section from its own function, and the
CPU per request of each process it names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from bench.measure import Measure, cpu_seconds, process_tree
from bench.report import Run, against_previous, cpu_table, headline_ratios, render
from bench.servers import FLASK_FLOOR, RAW_FLOOR, SERVICE, Server
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

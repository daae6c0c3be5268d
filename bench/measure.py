"""Measurement for `make bench`: wrk runs, and CPU accounting from /proc.

A Measure is what one wrk run saw, with the CPU spent meanwhile by the app (gunicorn's process
tree), its PostgreSQL backends, Redis, nginx's process tree, wrk, and the whole machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from tests.support.servers import LOOPBACK

ROOT = Path(__file__).resolve().parent.parent

WRK_DIR = ROOT / "bench" / "wrk"
STARTED = time.monotonic()


def log(message: str) -> None:
    """Progress on stdout, with the seconds since start."""
    print(f"[{time.monotonic() - STARTED:5.0f}s] {message}", flush=True)


@dataclass(frozen=True)
class Scenario:
    """One wrk run: a script of bench/wrk/ and the path of its URL."""

    name: str
    script: str
    path: str
    writes: bool = False


@dataclass(frozen=True)
class Target:
    """A running server as wrk drives it: where, whose CPU counts, wrk's environment."""

    port: int
    app_pids: Callable[[], list[int]]  # gunicorn's process tree
    nginx_pids: Callable[[], list[int] | None]  # nginx's, or None when wrk goes to gunicorn
    wrk_env: dict[str, str]


@dataclass
class Measure:
    """What one wrk run measured, and the CPU seconds spent meanwhile by the app, PostgreSQL,
    Redis, nginx, wrk, other processes and the whole machine (None: not measured)."""

    requests: int
    seconds: float
    p50_ms: float
    p99_ms: float
    errors: int
    app_cpu: float
    pg_cpu: float | None
    wrk_cpu: float
    other_cpu: float
    redis_cpu: float | None = None
    nginx_cpu: float | None = None
    machine_cpu: float = 0.0

    @property
    def rps(self) -> float:
        """Requests per second."""
        return self.requests / self.seconds if self.seconds else 0.0

    def per_request_us(self, cpu_seconds: float | None) -> float | None:
        """CPU seconds spread over the requests, in microseconds each."""
        if cpu_seconds is None or not self.requests:
            return None
        return cpu_seconds / self.requests * 1e6

    @property
    def app_us(self) -> float | None:
        """The server processes' CPU per request, µs."""
        return self.per_request_us(self.app_cpu)

    @property
    def pg_us(self) -> float | None:
        """The PostgreSQL backends' CPU per request, µs."""
        return self.per_request_us(self.pg_cpu)

    @property
    def redis_us(self) -> float | None:
        """Redis' CPU per request, µs."""
        return self.per_request_us(self.redis_cpu)

    @property
    def nginx_us(self) -> float | None:
        """nginx's CPU per request, µs."""
        return self.per_request_us(self.nginx_cpu)

    @property
    def machine_us(self) -> float | None:
        """The whole machine's CPU per request (every process, wrk and the noise included), µs."""
        return self.per_request_us(self.machine_cpu)


def summed(values: list[float | None]) -> float | None:
    """The sum, or None when any is None."""
    return None if any(value is None for value in values) else sum(v or 0.0 for v in values)


def combined(measures: list[Measure]) -> Measure:
    """Several runs as one: counts and CPU summed, latencies the median of the runs'."""
    return Measure(
        requests=sum(m.requests for m in measures),
        seconds=sum(m.seconds for m in measures),
        p50_ms=statistics.median(m.p50_ms for m in measures),
        p99_ms=statistics.median(m.p99_ms for m in measures),
        errors=sum(m.errors for m in measures),
        app_cpu=sum(m.app_cpu for m in measures),
        pg_cpu=summed([m.pg_cpu for m in measures]),
        wrk_cpu=sum(m.wrk_cpu for m in measures),
        other_cpu=sum(m.other_cpu for m in measures),
        redis_cpu=summed([m.redis_cpu for m in measures]),
        nginx_cpu=summed([m.nginx_cpu for m in measures]),
        machine_cpu=sum(m.machine_cpu for m in measures),
    )


# --- wrk ---------------------------------------------------------------------------------------


def ensure_program(name: str) -> None:
    """Make sure a program (wrk, nginx) is there: installed from Debian's package of that name
    when missing and we are root."""
    if shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin"):
        return
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        sys.exit(f"{name} is missing: install it (Debian: sudo apt-get install -y {name})")
    log(f"{name} is missing: apt-get update && apt-get install -y {name}")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", name]):
        subprocess.run(command, check=True, timeout=600, stdout=subprocess.DEVNULL)
    if not (shutil.which(name) or shutil.which(name, path="/usr/sbin:/sbin")):
        sys.exit(f"apt-get installed no {name}")


def run_wrk(
    target: Target,
    scenario: Scenario,
    duration: int,
    connections: int,
    threads: int,
    pg_pids: list[int] | None = None,
    redis_pids: list[int] | None = None,
) -> Measure:
    """Drive the server with wrk for `duration` seconds; what wrk measured and who spent CPU
    (the PostgreSQL backends and Redis only when their pids are given)."""
    command = [
        "wrk",
        f"-t{min(threads, connections)}",
        f"-c{connections}",
        f"-d{duration}s",
        "--latency",
        "--timeout",
        "5s",
        "-s",
        scenario.script,
        f"http://{LOOPBACK}:{target.port}{scenario.path}",
    ]
    app_pids, nginx_pids = target.app_pids(), target.nginx_pids()
    app_before = cpu_seconds(app_pids)
    pg_before = cpu_seconds(pg_pids or [])
    redis_before = cpu_seconds(redis_pids or [])
    nginx_before = cpu_seconds(nginx_pids or [])
    busy_before = machine_busy_seconds()
    wrk_before = children_cpu_seconds()
    with subprocess.Popen(
        command,
        cwd=WRK_DIR,
        env=target.wrk_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as wrk:
        try:
            stdout, stderr = wrk.communicate(timeout=duration + 60)
        except BaseException:  # a timeout, or Ctrl-C: leave no wrk behind, not even a zombie
            wrk.kill()
            wrk.wait()
            raise
    wrk_cpu = children_cpu_seconds() - wrk_before
    busy = machine_busy_seconds() - busy_before
    app_cpu = cpu_seconds(app_pids) - app_before
    pg_cpu = cpu_seconds(pg_pids or []) - pg_before
    redis_cpu = cpu_seconds(redis_pids or []) - redis_before
    nginx_cpu = cpu_seconds(nginx_pids or []) - nginx_before
    summary = [line[6:] for line in stdout.splitlines() if line.startswith("BENCH ")]
    if wrk.returncode != 0 or not summary:
        raise RuntimeError(f"wrk failed ({wrk.returncode}):\n{stdout}\n{stderr}")
    numbers = json.loads(summary[0])
    return Measure(
        requests=numbers["requests"],
        seconds=numbers["duration_us"] / 1e6,
        p50_ms=numbers["p50_us"] / 1e3,
        p99_ms=numbers["p99_us"] / 1e3,
        errors=sum(numbers[kind] for kind in ("connect", "read", "write", "status", "timeout")),
        app_cpu=app_cpu,
        pg_cpu=pg_cpu if pg_pids else None,
        wrk_cpu=wrk_cpu,
        other_cpu=max(0.0, busy - app_cpu - pg_cpu - redis_cpu - nginx_cpu - wrk_cpu),
        redis_cpu=redis_cpu if redis_pids else None,
        nginx_cpu=nginx_cpu if nginx_pids else None,
        machine_cpu=busy,
    )


# --- /proc -------------------------------------------------------------------------------------


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds spent so far by these processes (gone ones count 0)."""
    ticks = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / os.sysconf("SC_CLK_TCK")


def socket_ports(pids: list[int]) -> set[int]:
    """The local TCP ports of the sockets these processes hold (from /proc: their descriptors'
    socket inodes, found in /proc/net/tcp and tcp6)."""
    inodes = set()
    for pid in pids:
        with contextlib.suppress(OSError):
            for descriptor in Path(f"/proc/{pid}/fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(descriptor)
                    if target.startswith("socket:["):
                        inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[9] in inodes:
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


def process_tree(pid: int) -> list[int]:
    """A process and all its descendants (gone ones left out)."""
    found, pending = [], [pid]
    while pending:
        current = pending.pop()
        found.append(current)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{current}/task").iterdir():
                pending += [int(child) for child in (task / "children").read_text().split()]
    return found


def local_redis_pids(redis_url: str) -> list[int] | None:
    """The Redis server's pid when it runs on this machine, else None."""
    with contextlib.suppress(redis.RedisError, OSError):
        info: dict[str, Any] = redis.Redis.from_url(redis_url, socket_timeout=5).info("server")  # type: ignore[assignment]
        pid = int(info["process_id"])
        if "redis" in Path(f"/proc/{pid}/comm").read_text():
            return [pid]
    return None


def machine_busy_seconds() -> float:
    """CPU seconds the whole machine has spent not idle since boot."""
    fields = [int(each) for each in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def children_cpu_seconds() -> float:
    """CPU seconds of our finished children (wrk, once it has been waited for)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def peak_rss_kib(pid: int) -> int:
    """VmHWM of a process: its peak resident set size, in KiB."""
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1])
    return 0

"""What the bench report says of the machine: its facts, and the other processes' load."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path

from bench.database import Conn, redacted
from bench.measure import ROOT
from bench.report import Run


def machine_facts(conn: Conn, server_url: str | None) -> dict[str, str]:
    """What the report says about the machine and the code (no paths, no secrets)."""
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    models = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    mem_kib = int(Path("/proc/meminfo").read_text().split()[1])
    version = conn.execute("show server_version").fetchone()

    def output(*command: str) -> str:
        done = subprocess.run(
            command, cwd=ROOT, capture_output=True, text=True, timeout=10, check=False
        )
        return (done.stdout + done.stderr).strip()

    dirty = output("git", "status", "--porcelain", "petstore", "sql", "wsgi.py", "deploy")
    return {
        "cpu": models[0] if models else platform.machine(),
        "cores": str(os.cpu_count()),
        "memory": f"{mem_kib / 2**20:.0f} GiB",
        "postgres": f"PostgreSQL {version['server_version'].split()[0] if version else '?'}"
        + (" (the machine's)" if server_url else " (embedded)"),
        "python": f"Python {platform.python_version()}",
        "wrk": "wrk " + output("wrk", "-v").split(" [")[0].split("/")[-1],
        "commit": output("git", "rev-parse", "--short", "HEAD")
        + (" plus uncommitted changes to the service" if dirty else ""),
        "database": redacted(server_url) if server_url else "",
    }


def note_background_load(run: Run) -> None:
    """Say how many measures ran while other processes kept the machine busy."""
    every = [m for measures in run.rounds.values() for m in measures]
    busy = [m.other_cpu / m.seconds for m in every if m.seconds]
    noisy = [share for share in busy if share > 0.25]
    if noisy:
        run.notes.append(
            f"Other processes on the machine used more than a quarter of a core during "
            f"{len(noisy)} of {len(busy)} measures (up to {max(noisy):.2f} cores): those numbers "
            "are noisy; the CPU per request (from /proc) is steadier than requests/s."
        )

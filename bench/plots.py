"""The PNG plots of the bench report: each table size, and the service against the floor."""

from __future__ import annotations

from pathlib import Path

from bench.measure import combined
from bench.numbers import cpu_ratio, ratio, target_of
from bench.report import Run
from bench.servers import FLASK_FLOOR, RAW_FLOOR, SERVICE, Server


def plot_size(run: Run, size: int, path: Path) -> Path:
    """Requests/s and p99 per scenario, one bar per server, at one table size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    servers = [s for _title, group in run.groups for s in group]
    servers = [
        s for s in servers if any((size, s.label, n) in run.rounds for n in run.scenario_names)
    ]
    names = [
        n for n in run.scenario_names if any((size, s.label, n) in run.rounds for s in servers)
    ]
    figure, (top, bottom) = plt.subplots(2, 1, figsize=(13, 8.5), sharex=True)
    width = 0.8 / max(1, len(servers))
    colors = plot_colors(servers)
    for index, server in enumerate(servers):
        whole = [combined(run.rounds.get((size, server.label, n), [])) for n in names]
        positions = [x + (index - (len(servers) - 1) / 2) * width for x in range(len(names))]
        top.bar(positions, [m.rps for m in whole], width, label=server.label, color=colors[index])
        bottom.bar(positions, [m.p99_ms for m in whole], width, color=colors[index])
    top.set_ylabel("requests/s (higher is better)")
    bottom.set_ylabel("p99 latency, ms (lower is better)")
    bottom.set_xticks(range(len(names)), [wrapped(n) for n in names], fontsize=8)
    top.legend(fontsize=8, ncols=2)
    top.set_title(f"{size:,} pets: throughput and p99 per scenario (wrk, medians of rounds)")
    for axes in (top, bottom):
        axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def plot_summary(run: Run, path: Path) -> Path:
    """Service ÷ bare-Flask floor per scenario and storage at the first size, min–max bars, targets."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    size = min(run.sizes)
    figure, axes = plt.subplots(figsize=(11, 4.8))
    names = run.scenario_names
    width = 0.8 / max(1, len(run.groups))
    for index, (_title, servers) in enumerate(run.groups):
        pairs = [
            (
                run.rounds.get((size, servers[0].label, n), []),
                run.rounds.get((size, servers[1].label, n), []),
            )
            for n in names
        ]
        found = [ratio(ours, floor) for ours, floor in pairs]
        positions = [x + (index - (len(run.groups) - 1) / 2) * width for x in range(len(names))]
        medians = [each.median if each else 0.0 for each in found]
        low = [each.median - min(each.values) if each else 0.0 for each in found]
        high = [max(each.values) - each.median if each else 0.0 for each in found]
        axes.bar(
            positions,
            medians,
            width,
            yerr=[low, high],
            capsize=3,
            label=f"{servers[0].label} ÷ {servers[1].label}",
        )
        by_cpu = [cpu_ratio(ours, floor) for ours, floor in pairs]
        axes.plot(
            positions,
            [each.median if each else float("nan") for each in by_cpu],
            "D",
            color="black",
            markersize=5,
            label="CPU-based: Flask floor app µs ÷ service app µs" if not index else None,
        )
    for x, name in enumerate(names):
        axes.hlines(target_of(name), x - 0.45, x + 0.45, colors="black", linestyles="dashed")
    axes.axhline(1.0, color="grey", linewidth=0.8)
    axes.set_xticks(range(len(names)), [wrapped(n) for n in names], fontsize=8)
    axes.set_ylabel("service ÷ bare-Flask floor, requests/s")
    axes.set_title(
        f"The service against the bare-Flask floor, {size:,} pets "
        "(bars: median, min–max over rounds; dashed: target)"
    )
    axes.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncols=2)
    axes.grid(axis="y", alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, dpi=90)
    plt.close(figure)
    return path


def plot_colors(servers: list[Server]) -> list[str]:
    """Service dark, bare-Flask floor middle, raw floor light; blue for memory, orange for redis,
    green for redis through nginx."""
    shades = {
        ("nginx", SERVICE): "#1b6e3a",
        ("nginx", FLASK_FLOOR): "#4caf6e",
        ("nginx", RAW_FLOOR): "#a5d9b5",
        ("memory", SERVICE): "#1f4e99",
        ("memory", FLASK_FLOOR): "#4f8fdb",
        ("memory", RAW_FLOOR): "#a9c8ef",
        ("redis", SERVICE): "#b34700",
        ("redis", FLASK_FLOOR): "#f08a3c",
        ("redis", RAW_FLOOR): "#f7c79f",
    }
    return [shades.get(("nginx" if s.nginx else s.storage, s.app), "#888888") for s in servers]


def wrapped(name: str) -> str:
    """A scenario name on two lines at its middle space, for an axis label."""
    if len(name) < 22 or " " not in name:
        return name
    middle = len(name) // 2
    spaces = [i for i, c in enumerate(name) if c == " "]
    cut = min(spaces, key=lambda i: abs(i - middle))
    return name[:cut] + "\n" + name[cut + 1 :]

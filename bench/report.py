"""The report of `make bench`: what a run gathered, and its Markdown sections and tables.

Its numbers are bench/numbers.py's, its plots bench/plots.py's, what it says of the machine
bench/machine.py's.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from bench.measure import Measure, combined
from bench.numbers import cpu_ratio, fmt, ratio, target_of
from bench.servers import (
    GUNICORN_CONFIG,
    NGINX_CONFIG,
    NGINX_WORKERS,
    Server,
)


@dataclass
class Run:
    """Everything one benchmark run gathers for the report; every list holds one Measure per round."""

    groups: list[tuple[str, tuple[Server, ...]]] = field(default_factory=list)
    rounds: dict[tuple[int, str, str], list[Measure]] = field(default_factory=dict)
    # (the planner's estimate of the pets, the pets there are) after each of those rounds
    estimates: dict[tuple[int, str, str], list[tuple[int, int]]] = field(default_factory=dict)
    distance: dict[tuple[str, str], list[Measure]] = field(default_factory=dict)
    distance_servers: tuple[Server, ...] = ()
    distance_size: int = 0
    configs: dict[tuple[str, str], list[Measure]] = field(default_factory=dict)
    single: dict[tuple[str, str], Measure] = field(default_factory=dict)
    rss_kib: dict[tuple[int, str], list[int]] = field(default_factory=dict)
    plans: list[tuple[str, str, str]] = field(default_factory=list)
    budget: str = ""
    notes: list[str] = field(default_factory=list)
    commands: dict[str, str] = field(default_factory=dict)
    pages: dict[int, int] = field(default_factory=dict)
    sizes: list[int] = field(default_factory=list)
    scenario_names: list[str] = field(default_factory=list)
    size_pair: tuple[Server, ...] = ()  # the service on the small and on the large table


# --- tables ------------------------------------------------------------------------------------


def group_rows(
    run: Run, servers: tuple[Server, ...]
) -> Iterator[tuple[int, str, list[list[Measure]]]]:
    """(pets, scenario, each server's measures) of every row the first server measured, in order."""
    for size in run.sizes:
        for name in run.scenario_names:
            if (size, servers[0].label, name) in run.rounds:
                yield size, name, [run.rounds.get((size, s.label, name), []) for s in servers]


def comparison(run: Run, servers: tuple[Server, ...]) -> list[str]:
    """Service, bare-Flask floor, raw floor: requests/s, ratios over rounds, p99."""
    servers = servers[:3]  # a baseline build has a table of its own (against_baseline)
    lines = [
        "| pets | scenario | service req/s | Flask floor req/s | raw floor req/s "
        "| **service ÷ Flask floor** median (min–max) | halves (moved) | target "
        "| service ÷ raw floor | Flask floor ÷ raw floor | p99 ms service / Flask / raw |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, name, measures in group_rows(run, servers):
        whole = [combined(each) for each in measures]
        to_flask = ratio(measures[0], measures[1])
        to_raw = ratio(measures[0], measures[2])
        flask_to_raw = ratio(measures[1], measures[2])
        met = "n/a"
        if to_flask is not None:
            met = f"{target_of(name)} " + (
                "met" if to_flask.median >= target_of(name) else "missed"
            )
        lines.append(
            f"| {size:,} | {name} | {fmt(whole[0].rps)} | {fmt(whole[1].rps)} | "
            f"{fmt(whole[2].rps)} | {to_flask.cell() if to_flask else 'n/a'} | "
            f"{to_flask.halves_cell() if to_flask else 'n/a'} | {met} | "
            f"{to_raw.cell() if to_raw else 'n/a'} | "
            f"{flask_to_raw.cell() if flask_to_raw else 'n/a'} | "
            + " / ".join(fmt(each.p99_ms, 1) for each in whole)
            + " |"
        )
    return lines


def against_baseline(
    run: Run, servers: tuple[Server, ...], others: tuple[Server, ...] | None = None
) -> list[str]:
    """The service against each further server of its group (its build at an earlier commit,
    itself with a part switched off, or on a larger table; by default those after the floors),
    from the same paired rounds: requests/s and app CPU per request, each the median (min–max)
    of the rounds' ratios."""
    service = servers[0]
    lines = []
    for baseline in servers[3:] if others is None else others:
        lines += [
            f"The service against **{baseline.label}** (the same rounds): *req/s ratio* "
            "is the service's requests/s over the other's, round by round; *app CPU ratio* "
            "the service's app CPU per request over the other's, round by round (below 1: the "
            "service costs less).",
            "",
            "| pets | scenario | service req/s | other req/s | **req/s ratio** median (min–max) "
            "| service app µs | other app µs | **app CPU ratio** median (min–max) "
            "| p99 ms service / other |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for size, name, (ours, theirs) in group_rows(run, (service, baseline)):
            by_rps, by_cpu = ratio(ours, theirs), cpu_ratio(theirs, ours)
            whole, base = combined(ours), combined(theirs)
            lines.append(
                f"| {size:,} | {name} | {fmt(whole.rps)} | {fmt(base.rps)} "
                f"| {by_rps.cell() if by_rps else 'n/a'} | {fmt(whole.app_us)} "
                f"| {fmt(base.app_us)} | {by_cpu.cell() if by_cpu else 'n/a'} "
                f"| {fmt(whole.p99_ms, 1)} / {fmt(base.p99_ms, 1)} |"
            )
        lines.append("")
    return lines


def cpu_table(run: Run, servers: tuple[Server, ...]) -> list[str]:
    """CPU per request of each server: the app, PostgreSQL, Redis, nginx and the whole machine."""
    lines = [
        "| pets | scenario | server | app µs | PostgreSQL µs | Redis µs | nginx µs "
        "| whole machine µs | service ÷ this, app, median (min–max) | service ÷ this, "
        "whole machine | wrk (cores) | other processes (cores) |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for size, name, measures in group_rows(run, servers):
        whole = [combined(each) for each in measures]
        for server, these, this in zip(servers, measures, whole, strict=True):
            base = server is servers[0]
            by_app = None if base else cpu_ratio(these, measures[0])
            by_machine = (
                whole[0].machine_us / this.machine_us
                if not base and whole[0].machine_us and this.machine_us
                else None
            )
            seconds = this.seconds or 1.0
            lines.append(
                f"| {size:,} | {name} | {server.name} | {fmt(this.app_us)} | {fmt(this.pg_us)} "
                f"| {fmt(this.redis_us)} | {fmt(this.nginx_us)} | {fmt(this.machine_us)} "
                f"| {by_app.cell() if by_app else ''} | {fmt(by_machine, 2) if by_machine else ''} "
                f"| {this.wrk_cpu / seconds:.2f} | {this.other_cpu / seconds:.2f} |"
            )
    return lines


def distance_table(run: Run) -> list[str]:
    """Each step from the floors to the whole service: requests/s, ratios over rounds, CPU."""
    raw, flask_floor = run.distance_servers[0].label, run.distance_servers[1].label
    lines = [
        "| scenario | server | req/s | × Flask floor median (min–max) | × raw floor "
        "| app CPU µs/request | PostgreSQL µs/request |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for (name, label), measures in run.distance.items():
        whole = combined(measures)
        to_flask = ratio(measures, run.distance.get((name, flask_floor), []))
        to_raw = ratio(measures, run.distance.get((name, raw), []))
        lines.append(
            f"| {name} | {label} | {fmt(whole.rps)} | {to_flask.cell() if to_flask else 'n/a'} "
            f"| {to_raw.cell() if to_raw else 'n/a'} | {fmt(whole.app_us)} | {fmt(whole.pg_us)} |"
        )
    return lines


def configs_table(run: Run) -> list[str]:
    """The service on redis:// under each serving configuration, through nginx."""
    lines = [
        "| scenario | configuration | req/s | min–max req/s over rounds | p99 ms "
        "| app µs | PostgreSQL µs | Redis µs | nginx µs | whole machine µs |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    best: dict[str, list[tuple[float, float, str]]] = {}
    for (name, label), measures in run.configs.items():
        whole = combined(measures)
        rates = [m.rps for m in measures]
        lines.append(
            f"| {name} | {label} | {fmt(whole.rps)} | {fmt(min(rates))}–{fmt(max(rates))} "
            f"| {fmt(whole.p99_ms, 1)} | {fmt(whole.app_us)} | {fmt(whole.pg_us)} "
            f"| {fmt(whole.redis_us)} | {fmt(whole.nginx_us)} | {fmt(whole.machine_us)} |"
        )
        best.setdefault(name, []).append((whole.rps, whole.machine_us or 0.0, label))
    lines.append("")
    for name, found in best.items():
        fastest, leanest = max(found), min(found, key=lambda each: each[1])
        lines.append(
            f"- {name}: most requests/s with {fastest[2]} ({fmt(fastest[0])}); least CPU of "
            f"the whole machine per request with {leanest[2]} ({fmt(leanest[1])} µs)."
        )
    return lines


def size_table(run: Run, service: str, floor: str) -> list[str]:
    """The deep and the filtered page against the first: median latency, PostgreSQL CPU."""
    lines = [
        "| page | service p50 ms | × first page | raw floor p50 ms | × first page "
        "| PostgreSQL CPU µs/request | × first page |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    names = list(dict.fromkeys(name for (_label, name) in run.single))

    def cells(label: str, name: str, value: Callable[[Measure], float | None], digits: int) -> str:
        this, first = run.single.get((label, name)), run.single.get((label, names[0]))
        mine = value(this) if this else None
        base = value(first) if first else None
        share = mine / base if mine is not None and base else None
        return f"{fmt(mine, digits)} | {fmt(share, 2)}"

    for name in names:
        lines.append(
            f"| {name} | {cells(service, name, lambda m: m.p50_ms, 2)} "
            f"| {cells(floor, name, lambda m: m.p50_ms, 2)} "
            f"| {cells(floor, name, lambda m: m.pg_us, 0)} |"
        )
    return lines


def stability(run: Run) -> str:
    """How far the medians of service ÷ Flask floor moved between the halves of the rounds."""
    sentences = []
    for what, ratio_of in (
        ("service ÷ bare-Flask floor (requests/s)", ratio),
        ("its CPU-based counterpart (Flask floor app µs ÷ service app µs)", cpu_ratio),
    ):
        moves = []
        for _title, servers in run.groups:
            for size, name, (ours, floor) in group_rows(run, servers[:2]):
                found = ratio_of(ours, floor)
                moved = found.moved() if found else None
                if moved is not None:
                    moves.append((moved, f"{servers[0].storage}://, {size:,} pets, {name}"))
        if not moves:
            return "Stability: too few rounds to split into halves."
        moves.sort()
        under = sum(1 for moved, _where in moves if moved < 0.05)
        sentences.append(
            f"the median of {what} moved by {statistics.median(m for m, _w in moves):.1%} "
            f"(median over the {len(moves)} ratios), by less than 5% in {under} of "
            f"{len(moves)}, at most {moves[-1][0]:.1%} ({moves[-1][1]})"
        )
    return f"Stability, with the rounds split into two halves: {'; '.join(sentences)}."


HEADLINE = "**service ÷ Flask floor**"
PREVIOUS = "<the comparison with the previous report>"


def headline_ratios(text: str) -> dict[tuple[str, str, str], float]:
    """The medians of service ÷ Flask floor in a report: (storage, pets, scenario) -> median."""
    found: dict[tuple[str, str, str], float] = {}
    storage, column = "", None
    for line in text.splitlines():
        if line.startswith("## "):
            storage, column = line[3:].split(" ", 1)[0], None
        elif line.startswith("| pets |") and HEADLINE in line:
            column = [cell.strip() for cell in line.split("|")].index(
                next(c.strip() for c in line.split("|") if HEADLINE in c)
            )
        elif column is not None and line.startswith("| ") and "**" in line:
            cells = [cell.strip() for cell in line.split("|")]
            with contextlib.suppress(ValueError, IndexError):
                median = float(cells[column].split("**")[1])
                found[(storage, cells[1], cells[2])] = median
    return found


def against_previous(text: str, previous: Path | None) -> str:
    """How far the medians of service ÷ Flask floor moved since the previous report."""
    if previous is None:
        return "No earlier report with the bare-Flask floor in this directory to compare with."
    before, now = headline_ratios(previous.read_text()), headline_ratios(text)
    moves = sorted(
        (abs(now[row] - before[row]) / before[row], row)
        for row in now.keys() & before.keys()
        if before[row]
    )
    if not moves:
        return f"No row in common with the previous report ({previous.name})."
    under = sum(1 for moved, _row in moves if moved < 0.05)
    worst, (storage, pets, name) = moves[-1]
    return (
        f"Against the previous report ({previous.name}), the median of service ÷ bare-Flask "
        f"floor moved by {statistics.median(m for m, _r in moves):.1%} (median over the "
        f"{len(moves)} ratios in both), by less than 5% in {under} of {len(moves)}, at most "
        f"{worst:.1%} ({storage} {pets} pets, {name})."
    )


def introduction(
    run: Run, facts: dict[str, str], settings: dict[str, str], wall: float, pictures: list[Path]
) -> list[str]:
    """The title, the machine, the load, the servers and how to read the ratios."""
    machine = (
        f"{time.strftime('%Y-%m-%d')}, commit {facts['commit']}. **Numbers from one run on one "
        f"machine** ({facts['cpu']}, {facts['cores']} cores, {facts['memory']}; "
        f"{facts['postgres']}, {facts['python']}, {facts['wrk']}); wrk, nginx, PostgreSQL, "
        f"Redis and gunicorn share these cores. The run took {wall / 60:.1f} min."
    )
    load = (
        f"Load: wrk with {settings['threads']} thread(s) and {settings['connections']} "
        "connections; interleaved rounds of "
        f"{settings['duration']} s (each round runs every scenario on every server in turn, so "
        "both sides of a ratio see about the same background load), after a "
        f"{settings['warmup']} s mixed warm-up of each server. Every server is gunicorn with "
        f"`{GUNICORN_CONFIG}` and its defaults (redis://: sync workers, one per core + 1; "
        "memory://: one gthread worker × 4 threads), the pool sized to the threads. The "
        f"headline goes through the shipped nginx site (`{NGINX_CONFIG}`, only its upstream "
        f"server, listen address and access log replaced; {NGINX_WORKERS} nginx workers, one "
        "nginx per server), as in production."
    )
    if not run.groups:
        return ["# Benchmark: serving configurations through nginx", "", machine, "", load, ""]
    return [
        "# Benchmark: the service against the bare-Flask floor and the raw floor",
        "",
        machine,
        "",
        load + " Three servers per group:",
        "",
        "- the **service**;",
        "- the **bare-Flask floor** (`bench/flask_floor.py`): a plain Flask app doing the "
        "essential work: the same key query, the same SQL (petstore.queries), a per-key minute + "
        "day fixed-window counter with X-RateLimit-* headers (in-process for memory://, one Lua "
        "call per window in Redis for redis://), Error JSON; no marshmallow, flask-limiter or "
        "request log. **The headline ratio is service ÷ bare-Flask floor**;",
        "- the **raw floor** (`bench/floor.py`): the same essential work without Flask and "
        "without counting: the physical limit on this stack.",
        "",
        "The floors' answers are compared with the service's first (status, body bytes, Link). "
        "Ratios are paired: each round runs every server once on a scenario, in an order that "
        "rotates from round to round, and a ratio is the median (min–max) of the rounds' own "
        "ratios, never a ratio of medians (bench/results/README.rst says why); *halves* gives the "
        "medians of the first and the second half of the rounds and how far apart they are. Pets "
        "that a run creates are deleted after it. Deep page: "
        + ", ".join(f"page {page:,} at {size:,} pets" for size, page in run.pages.items())
        + ", then `Link: rel=next`.",
        "",
        stability(run),
        "",
        PREVIOUS,
        "",
        *(f"![{picture.stem}]({picture.name})" for picture in pictures),
        "",
    ]


def groups_section(run: Run) -> list[str]:
    """Requests/s and the ratios of each group, the headline first."""
    out = []
    for title, servers in run.groups:
        rounds = max(
            (len(m) for (_s, label, _n), m in run.rounds.items() if label == servers[0].label),
            default=0,
        )
        out += [
            f"## {title}",
            "",
            f"{rounds} paired rounds.",
            "",
            *comparison(run, servers),
            "",
            *against_baseline(run, servers),
        ]
    return out


def churn_section(run: Run) -> list[str]:
    """The filtered page round by round: what the churn of the creates before it left."""
    keys = [key for key in run.estimates if "status=" in key[2]]
    if not keys:
        return []
    out = [
        "## The filtered page, round by round",
        "",
        "After each run of creates the harness deletes them and runs a plain `VACUUM`, never "
        "`ANALYZE` (bench/results/README.rst): the planner's estimate of the table is what "
        "that leaves. Per round: requests/s, the PostgreSQL CPU per request of that server's "
        "backends, and the estimate against the pets there were, read right after the round.",
        "",
        "| pets | server | round | req/s | PostgreSQL µs/req | estimate / pets |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for size, label, name in keys:
        measures = run.rounds.get((size, label, name), [])
        for number, (measure, (estimate, live)) in enumerate(
            zip(measures, run.estimates[(size, label, name)], strict=False), start=1
        ):
            pg = measure.per_request_us(measure.pg_cpu)
            out.append(
                f"| {size:,} | {label} | {number} | {measure.rps:,.0f} | "
                f"{'–' if pg is None else f'{pg:,.0f}'} | {estimate:,} / {live:,} |"
            )
    return [*out, ""]


def cpu_section(run: Run) -> list[str]:
    """CPU per request of each server in each group."""
    if not run.groups:
        return []
    out = [
        "## CPU per request",
        "",
        "From /proc, utime + stime before and after each round, summed over the rounds and "
        "spread over the requests: gunicorn's process tree (app), the PostgreSQL backends of "
        "that server's own connections (not the other servers', idle on the same database), "
        "the Redis server (when it runs on this machine, for the redis:// groups), "
        "nginx's process tree (the headline), and the whole machine (/proc/stat: every process, "
        "wrk and the noise included). *service ÷ this, app* is what this server's requests/s "
        "over the service's would be if both were bound by their own CPU: it moves less with "
        "background load than requests/s do. Then the cores wrk used, and those every other "
        "process on the machine used meanwhile (noise, when it is not 0; Redis and PostgreSQL "
        "may serve other clients too).",
        "",
    ]
    for title, servers in run.groups:
        out += [f"### {title}", "", *cpu_table(run, servers), ""]
    return out


def distance_section(run: Run) -> list[str]:
    """Where the distance between the floors and the service goes."""
    if not run.distance:
        return []
    return [
        f"## Where the distance goes ({run.distance_size:,} pets, memory://, 1 worker)",
        "",
        "The floors, the service with parts switched off, and the whole service: the "
        "service without the limiter is the factory called with `RATELIMIT_ENABLED` off, "
        "and `PETSTORE_LOG_LEVEL=warning` drops the request log. Interleaved rounds as above.",
        "",
        *distance_table(run),
        "",
    ]


def configs_section(run: Run, settings: dict[str, str]) -> list[str]:
    """The serving configurations through nginx."""
    if not run.configs:
        return []
    return [
        "## Serving configurations (the service on redis://, through nginx)",
        "",
        "gunicorn's worker class, workers × threads, set through `GUNICORN_WORKER_CLASS`, "
        "`WEB_CONCURRENCY` and `PETSTORE_THREADS` (the pool follows the threads), each behind "
        "its own nginx with the shipped site: a sync worker closes every connection after its "
        "answer, so nginx opens a new one per request; gthread workers keep nginx's upstream "
        f"connections alive (`GUNICORN_KEEPALIVE`). {settings['config_rounds']} interleaved "
        "rounds.",
        "",
        *configs_table(run),
        "",
    ]


def budget_section(run: Run) -> list[str]:
    """The in-process per-request budget."""
    return ["## The per-request budget, in-process", "", run.budget, ""] if run.budget else []


def size_section(run: Run, settings: dict[str, str]) -> list[str]:
    """The cost against table size."""
    if not run.single:
        return []
    return [
        f"## Cost against table size ({max(run.sizes):,} pets, 1 connection)",
        "",
        "One connection (no queueing), rounds of 1 s with each page on each server in turn; "
        "the median of the rounds' median latencies. Target: the deep page and a filtered "
        "page within 1.2× of the first page. The PostgreSQL column is the raw floor's "
        "backends' CPU per request, the part that would grow with the table.",
        "",
        *size_table(run, settings["size_service"], settings["size_floor"]),
        "",
    ]


def table_size_section(run: Run) -> list[str]:
    """The same service on a small and a large table, through nginx, in paired rounds."""
    if not run.size_pair:
        return []
    small, large = run.size_pair
    return [
        f"## The same service at {small.pets:,} and {large.pets:,} pets (production path)",
        "",
        "Two scratch databases seeded alike, one service on each (through its own nginx, "
        "redis://), the read scenarios in paired rounds in a rotation. Target: every read at "
        f"{large.pets:,} pets at least 0.9× the requests/s at {small.pets:,}, that is a "
        "*req/s ratio* (the smaller table's over the larger's) of at most 1.11. The deep page "
        "is the one before the last.",
        "",
        *against_baseline(run, run.size_pair, (large,)),
        *cpu_table(run, run.size_pair),
        "",
    ]


def rss_section(run: Run) -> list[str]:
    """Peak RSS per worker of each server."""
    if not run.rss_kib:
        return []
    return [
        "## Peak RSS per worker (VmHWM, read just before stopping the server)",
        "",
        "| pets | server | MiB per worker |",
        "|---:|---|---|",
        *(
            f"| {size:,} | {label} | {', '.join(f'{kib / 1024:.0f}' for kib in kibs)} |"
            for (size, label), kibs in run.rss_kib.items()
        ),
        "",
    ]


def notes_section(run: Run) -> list[str]:
    """What the run noticed: answers unlike the service's, errors, background load."""
    return ["## Notes", "", *(f"- {note}" for note in run.notes), ""] if run.notes else []


def plans_section(run: Run) -> list[str]:
    """EXPLAIN (ANALYZE, BUFFERS) of the list queries at the largest size."""
    if not run.plans:
        return []
    out = [f"## Plans at {max(run.sizes):,} pets (`EXPLAIN (ANALYZE, BUFFERS)`)", ""]
    for title, query, plan in run.plans:
        out += [f"### {title}", "", "```sql", query, "```", "", "```", plan, "```", ""]
    return out


def commands_section(run: Run, settings: dict[str, str]) -> list[str]:
    """The bench's own command, each server's, and wrk's."""
    return [
        "## Commands",
        "",
        "```",
        settings["invocation"],
        *run.commands.values(),
        "cd bench/wrk && BENCH_KEY=<enterprise key> BENCH_MIN_ID=<min> BENCH_MAX_ID=<max> \\",
        f"    wrk -t{settings['threads']} -c{settings['connections']} -d{settings['duration']}s "
        "--latency --timeout 5s -s <get|follow|pet|post|mixed>.lua http://127.0.0.1:<port><path>",
        "```",
        "",
    ]


def render(
    run: Run,
    facts: dict[str, str],
    settings: dict[str, str],
    wall: float,
    pictures: list[Path],
    previous: Path | None = None,
) -> str:
    """The Markdown report: one section after another, those the run has numbers for."""
    out = [
        *introduction(run, facts, settings, wall, pictures),
        *groups_section(run),
        *cpu_section(run),
        *churn_section(run),
        *distance_section(run),
        *configs_section(run, settings),
        *budget_section(run),
        *size_section(run, settings),
        *table_size_section(run),
        *rss_section(run),
        *notes_section(run),
        *plans_section(run),
        *commands_section(run, settings),
    ]
    text = "\n".join(out)
    return text.replace(PREVIOUS, against_previous(text, previous))


def previous_report(directory: Path) -> Path | None:
    """The newest report in `directory` with the bare-Flask floor (read before it is replaced)."""
    reports = sorted(directory.glob("*.md"), key=lambda each: each.stat().st_mtime)
    found = [each for each in reports if HEADLINE in each.read_text(errors="replace")]
    return found[-1] if found else None

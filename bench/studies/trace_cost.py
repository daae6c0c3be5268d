"""The cost of tracing per request (petstore.tracing), in-process: `python -m bench.studies.trace_cost`.

CPU of this thread only (time.thread_time), best of interleaved rounds, as usage_cost measures:
(1) off, the extra installed and no OTEL_TRACES_EXPORTER: the tracing hooks one request runs,
each a check of a module-level None, called alone in a request context (a whole request cannot
be measured without them); (2) a whole GET /v1/pets?limit=20 through WSGI untraced, and traced
with 1% and 100% of requests sampled, through the service's own provider (tracing.make_provider:
the bounded batch queue) into an exporter that encodes each batch as OTLP/HTTP would and sends
nothing. The batch thread's encoding is CPU of another thread, so it is reported on its own, per
request. Needs DATABASE_URL (a migrated database; a key is created in it).
"""

from __future__ import annotations

import argparse
import functools
import os

from bench.inprocess import (
    EncodingExporter,
    caller,
    close_app,
    hooks_off,
    interleaved_best,
    provider_sampling,
    request_log_to_null,
)
from petstore import config, create_app, db, keys, tracing

# The sampling ratios measured, by name; None: tracing off.
RATIOS: dict[str, float | None] = {"off": None, "1%": 0.01, "100%": 1.0}
# CPU µs added per request at most (issue 38).
TARGETS_US = {"off": 5, "1%": 30, "100%": 300}


def request_costs(requests: int, rounds: int) -> tuple[dict[str, float], dict[str, float]]:
    """CPU µs of a whole request by sampling (RATIOS), best interleaved rounds; and the batch
    thread's encoding CPU µs per request by sampling."""
    settings = config.from_environ()
    with db.connect(settings) as conn:
        key, _row = keys.issue_key(conn, "enterprise", "bench tracing", 10**9, 10**9)
    app = create_app({"USAGE_FLUSH_SECONDS": 3600.0, "IP_LIMITS": "1000000000/minute"})
    handler = request_log_to_null()
    exporters = {name: EncodingExporter() for name, ratio in RATIOS.items() if ratio is not None}
    providers = {
        name: None if ratio is None else provider_sampling(ratio, exporters[name])
        for name, ratio in RATIOS.items()
    }
    call = caller(app, key)
    try:
        best = interleaved_best(
            call,
            {name: functools.partial(tracing.use, made) for name, made in providers.items()},
            requests,
            rounds,
        )
        for provider in providers.values():
            if provider is not None:
                provider.force_flush()
    finally:
        tracing.use(None)
        close_app(app)
        handler.close()
        os.close(handler.fd)
    calls = requests * (rounds + 1) + rounds + 1
    encoding = {name: exporter.cpu / calls * 1e6 for name, exporter in exporters.items()}
    return {name: cpu / requests * 1e6 for name, cpu in best.items()}, encoding


def main() -> None:
    """Print the costs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200_000)
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    off = hooks_off(os.environ["DATABASE_URL"], args.calls, args.rounds)
    whole, encoding = request_costs(args.requests, args.rounds)
    print(
        f"tracing off, the hooks of one request: {off:6.2f} µs CPU (target ≤ {TARGETS_US['off']})"
    )
    print(f"GET /v1/pets?limit=20 untraced:          {whole['off']:6.1f} µs CPU per request")
    for name in ("1%", "100%"):
        added = whole[name] - whole["off"]
        print(
            f"GET /v1/pets?limit=20 sampling {name:>4}:     {whole[name]:6.1f} µs CPU per request, "
            f"{added:+6.1f} µs added (target ≤ {TARGETS_US[name]}); the batch thread's encoding "
            f"{encoding[name]:.1f} µs more"
        )


if __name__ == "__main__":
    main()

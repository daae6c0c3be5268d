"""The request path, in order. create_app registers `before_view` and `after_view`: the stages of
the service's own around a view (ProxyFix, the error handlers and db's teardown run around it too).

    identify → count → refuse banned → require a key → require a scope → view → headers → log

- identify (auth): the key of the request, or the 401 it will get; a database that cannot be
  asked is a 503 right here, with no budget spent.
- count (budgets): one request off the caller's budget (the key's, else the client address's);
  429 when it is spent, with a strike against the key (bans).
- refuse banned (bans): a banned key gets 429 api_key_banned and spends nothing.
- require a key (auth): the 401 found by identify (unknown, revoked or expired key).
- require a scope (auth): 403 insufficient_scope when the key lacks the scope its view
  declares (auth.needs_scope), else its method's: read for GET and HEAD, write for any other.
  After counting, so the 403 spends budget.
- view: parses with a schema, runs its queries on the request's connection (autocommit).
- headers (budgets): X-RateLimit-* on every counted /v1 answer, errors included.
- trace (tracing, when on): the server span of a /v1 request, from here to the log, and spans
  of the key lookup, the count, each statement and a durable write.
- log (logs): the request id header and one JSON line (with the trace's ids); metrics
  (metrics): the request tallied by operation and status, with its latency; usage (usage): a
  /v1 request counted for its key (or the aggregate of requests without a valid key) by hour
  and outcome, written in batches.

A view marked auth.uncounted (GET /v1/rate_limit) skips counting, bans and scopes for a
valid key; without one it is counted and refused like any other path.

Paths outside /v1 (the health probes, /metrics) only get the request id, the log line and
the tally: no trace.
"""

from __future__ import annotations

from flask import Flask, Response, g, request

from petstore import auth, logs, metrics, tracing, usage, web
from petstore.errors import DATABASE_UNAVAILABLE
from petstore.ratelimit import bans, budgets


def before_view() -> None:
    """Everything between the request's arrival and its view."""
    logs.start_request()
    if not web.in_api():
        return
    g.trace = tracing.start_request()  # the server span, when tracing is on
    if request.method == "POST":
        # Before a pooled connection is taken: a slow body holds a thread, never a connection.
        g.body = web.read_body_or_error()
    view = auth.current_view()
    try:
        caller, refusal = auth.identify_caller(view)
    except DATABASE_UNAVAILABLE:
        g.rate_limit_headers = budgets.show_unspent()
        raise
    g.caller = caller  # for the view (idempotency records are per key) and the log line
    if caller is not None and getattr(view, "uncounted", False):
        return  # GET /v1/rate_limit: a valid key's own standing, never counted nor refused
    with tracing.span("ratelimit.count") as counting:
        if caller is None or caller.banned_until is None:
            g.rate_limit_headers, limited = budgets.count(caller)
        else:
            g.rate_limit_headers, limited = bans.refuse_banned(caller)
        if counting.is_recording():
            counting.set_attribute("petstore.ratelimit.outcome", budgets.outcome(limited))
    if limited is not None:
        g.limited_code = limited.code  # for the metrics: the 429's code, not parsed back
        raise limited
    auth.require_caller(refusal)
    auth.require_scope(caller, view)


def after_view(response: Response) -> Response:
    """Everything between the view's answer (or error) and the client."""
    # Only where before_view counted or refused: /v1 paths.
    budgets.set_headers(response, g.get("rate_limit_headers"))
    logs.finish_request(response)
    metrics.observe_request(response, g.get("limited_code"))
    usage.count_request(response)
    tracing.finish_request(g.get("trace"), response)
    return response


def init_app(app: Flask) -> None:
    """Register the request path: one hook before the view, one after."""
    app.before_request(before_view)
    app.after_request(after_view)

"""GET /metrics in one process (Flask test client): what each request counts, and under which labels."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import logging
import os
import pkgutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from flask import Flask
from flask.testing import FlaskClient
from prometheus_client import Counter, Histogram
from prometheus_client.mmap_dict import MmapedDict, mmap_key
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.parser import text_string_to_metric_families

from petstore import config, create_app, metrics, openapi, views
from petstore.config import ConfigError
from petstore.db import get_conn
from tests.support.checks import assert_error
from tests.support.servers import LOOPBACK, free_port, poll_until

IN_USE = "petstore_db_pool_connections_in_use"
Scrape = dict[tuple[str, frozenset[tuple[str, str]]], float]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def scrape(client: FlaskClient) -> Scrape:
    """GET /metrics, parsed: (sample name, labels) -> value."""
    response = client.get("/metrics")
    assert response.status_code == 200
    samples: Scrape = {}
    for family in text_string_to_metric_families(response.get_data(as_text=True)):
        for sample in family.samples:
            samples[sample.name, frozenset(sample.labels.items())] = sample.value
    return samples


def value(samples: Scrape, name: str, **labels: str) -> float:
    """One sample's value; 0 when the series does not exist (yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def requests_of(samples: Scrape, operation: str, status: int) -> float:
    return value(samples, "petstore_http_requests_total", operation=operation, status=str(status))


def test_metrics_answer_the_text_format_without_key_limit_or_headers(
    make_app: Callable[..., Flask],
) -> None:
    client = make_app(IP_LIMITS="2/minute;1000/day").test_client()
    for _ in range(5):
        response = client.get("/metrics")
        assert response.status_code == 200
        assert response.content_type.startswith("text/plain; version=")
        assert not [name for name in response.headers.keys() if name.startswith("X-RateLimit")]
    assert client.get("/v1/metrics").status_code == 401  # not under /v1


def test_requests_count_by_operation_and_status_never_by_path(
    client: FlaskClient, api_key: str
) -> None:
    for _ in range(3):
        assert client.get("/v1/pets", headers=bearer(api_key)).status_code == 200
    created = client.post("/v1/pets", headers=bearer(api_key), json={"name": "a", "categoryId": 1})
    assert created.status_code == 201
    bad = client.post("/v1/pets", headers=bearer(api_key), json={"name": ""})
    assert_error(bad, 400, "invalid_request")
    assert client.get("/v1/pets/98765", headers=bearer(api_key)).status_code == 404
    assert client.get("/v1/pets/1", headers=bearer(api_key)).status_code == 200
    assert client.get("/v1/store/orders", headers=bearer(api_key)).status_code == 501
    assert client.get("/v1/pets").status_code == 401
    assert client.get("/v1/no/such/thing/42", headers=bearer(api_key)).status_code == 404
    assert client.delete("/v1/pets", headers=bearer(api_key)).status_code == 405

    samples = scrape(client)
    assert requests_of(samples, "listPets", 200) == 3
    assert requests_of(samples, "listPets", 401) == 1
    assert requests_of(samples, "createPet", 201) == 1
    assert requests_of(samples, "createPet", 400) == 1
    assert requests_of(samples, "getPet", 404) == 1
    assert requests_of(samples, "getPet", 200) == 1
    assert requests_of(samples, "listOrders", 501) == 1
    assert requests_of(samples, "unknown", 404) == 1
    assert requests_of(samples, "unknown", 405) == 1
    name = "petstore_http_request_duration_seconds_count"
    assert value(samples, name, operation="listPets") == 4
    operations = {
        dict(labels).get("operation")
        for (sample, labels) in samples
        if sample.startswith("petstore_http_")
    }
    counted = client.application.extensions[metrics.EXTENSION].operations
    assert operations <= {*counted.values(), metrics.UNKNOWN}
    text = client.get("/metrics").get_data(as_text=True)
    for chosen_by_client in (api_key, "98765", "/v1/no", "such"):
        assert chosen_by_client not in text


def test_latency_buckets_resolve_1_to_50_ms(client: FlaskClient, api_key: str) -> None:
    client.get("/v1/pets", headers=bearer(api_key))
    samples = scrape(client)
    bounds = sorted(
        float(dict(labels)["le"])
        for (name, labels) in samples
        if name == "petstore_http_request_duration_seconds_bucket"
        and dict(labels)["operation"] == "listPets"
    )
    in_range = [b for b in bounds if 0.001 <= b <= 0.05]
    assert len(in_range) >= 10 and in_range[0] == 0.001 and in_range[-1] == 0.05
    # At most 50 % apart, so a quantile inside 1-50 ms is off by less than one bucket's width.
    assert all(high / low <= 2.0 for low, high in zip(in_range, in_range[1:], strict=False))
    total = value(samples, "petstore_http_request_duration_seconds_count", operation="listPets")
    assert total == 1
    observed = value(samples, "petstore_http_request_duration_seconds_sum", operation="listPets")
    assert 0 < observed < 10


def test_every_api_operation_has_its_id(app: Flask) -> None:
    """Each /v1 route maps to the operationId the OpenAPI document gives it."""
    document = openapi.build_document(app.config, views.RESOURCES)
    documented = {
        (method.upper(), "/v1" + path.replace("{petId}", "<pet_id>")): operation["operationId"]
        for path, operations in document["paths"].items()
        for method, operation in operations.items()
    }
    routed = {
        (method, rule.rule): app.extensions[metrics.EXTENSION].operation(rule.endpoint)
        for rule in app.url_map.iter_rules()
        for method in rule.methods or ()
        if (method, rule.rule) in documented
    }
    assert routed == documented


def test_every_resource_route_is_described_and_counted(app: Flask) -> None:
    """A resource's view without a description, or a description without a view, fails here."""
    resources = {resource.name for resource in views.RESOURCES}
    routed = {
        rule.endpoint
        for rule in app.url_map.iter_rules()
        if rule.endpoint.partition(".")[0] in resources
    }
    ids = views.operation_ids(app)
    assert set(ids) == routed
    assert len(set(ids.values())) == len(views.operations())


def test_every_views_module_is_registered(app: Flask) -> None:
    """A blueprint that create_app forgets serves nothing: each views module's is registered."""
    names = [info.name for info in pkgutil.iter_modules(views.__path__)]
    blueprints = {importlib.import_module(f"petstore.views.{name}").bp.name for name in names}
    assert blueprints <= set(app.blueprints)


def test_429s_by_code_bans_and_replays(
    make_app: Callable[..., Flask], issue_key: Callable[..., str]
) -> None:
    client = make_app(BAN_THRESHOLD=2).test_client()
    key = issue_key("enterprise", per_minute=2, per_day=1000)
    statuses = [client.get("/v1/pets", headers=bearer(key)).status_code for _ in range(5)]
    assert statuses == [200, 200, 429, 429, 429]
    pet = {"name": "a", "categoryId": 1}
    other = issue_key("pro")
    headers = bearer(other) | {"Idempotency-Key": "k-1"}
    assert client.post("/v1/pets", headers=headers, json=pet).status_code == 201
    replayed = client.post("/v1/pets", headers=headers, json=pet)
    assert replayed.headers["Idempotent-Replayed"] == "true"
    conflict = client.post("/v1/pets", headers=headers, json={"name": "b", "categoryId": 1})
    assert_error(conflict, 409, "idempotency_key_reused")

    samples = scrape(client)
    assert value(samples, "petstore_too_many_requests_total", code="rate_limited") == 2
    assert value(samples, "petstore_too_many_requests_total", code="api_key_banned") == 1
    assert value(samples, "petstore_bans_created_total") == 1
    assert value(samples, "petstore_idempotent_replays_total") == 1
    assert requests_of(samples, "listPets", 429) == 3


def test_database_unavailable_counts_by_kind(make_app: Callable[..., Flask], api_key: str) -> None:
    nowhere = f"postgresql://postgres@{LOOPBACK}:{free_port()}/petstore"
    client = make_app(DATABASE_URL=nowhere, DB_POOL_TIMEOUT=0.1).test_client()
    response = client.get("/v1/pets", headers=bearer(api_key))
    assert_error(response, 503, "service_unavailable")
    samples = scrape(client)
    assert value(samples, "petstore_database_errors_total", kind="pool_timeout") == 1
    assert requests_of(samples, "listPets", 503) == 1


def test_limiter_storage_failure_and_fallback(make_app: Callable[..., Flask], api_key: str) -> None:
    nowhere = f"redis://{LOOPBACK}:{free_port()}/0"
    client = make_app(RATELIMIT_STORAGE_URI=nowhere, REDIS_TIMEOUT=0.1).test_client()
    before = scrape(client)
    assert value(before, "petstore_ratelimit_storage_fallback") == 0
    for _ in range(3):
        assert client.get("/v1/pets", headers=bearer(api_key)).status_code == 200
    samples = scrape(client)
    assert value(samples, "petstore_ratelimit_storage_errors_total") == 1
    assert value(samples, "petstore_ratelimit_storage_fallback") == 1


def test_pool_gauges_and_build_info(make_app: Callable[..., Flask]) -> None:
    app = make_app(DB_POOL_SIZE=3)
    client = app.test_client()
    samples = poll_until(
        lambda: scrape(client),
        # Connections being opened count as in use until they are ready.
        lambda s: (value(s, "petstore_db_pool_size"), value(s, IN_USE)) == (3, 0),
        within=10.0,
    )
    assert value(samples, "petstore_db_pool_size") == 3
    assert value(samples, IN_USE) == 0
    assert value(samples, "petstore_db_pool_requests_waiting") == 0
    version = importlib.metadata.version("petstore")
    assert value(samples, "petstore_build_info", version=version, getpet_sunset="2030-12-05") == 1


def test_each_scrape_gives_this_process_cpu_memory_and_descriptors(client: FlaskClient) -> None:
    """The process gauges: under gunicorn one series per live worker, labelled by its pid."""
    first = scrape(client)
    cpu = value(first, "petstore_worker_cpu_seconds")
    assert 0 < cpu <= time.process_time()
    rss = value(first, "petstore_worker_resident_memory_bytes")
    assert 10 * 2**20 < rss < 4 * 2**30
    fds = value(first, "petstore_worker_open_fds")
    with contextlib.ExitStack() as files:
        for _ in range(20):
            files.enter_context(open(os.devnull, "rb"))
        held = value(scrape(client), "petstore_worker_open_fds")
    # The pool may close or open a connection meanwhile.
    assert fds >= 3 and held >= fds + 15
    sum(range(3_000_000))  # some CPU time
    assert value(scrape(client), "petstore_worker_cpu_seconds") > cpu


def test_a_request_holding_a_connection_shows_in_use(app: Flask) -> None:
    app.extensions["petstore.pool"].wait(timeout=10)
    with app.test_request_context("/v1/pets"):
        get_conn()
        metrics.sample(app)
        gauge = app.extensions[metrics.EXTENSION].pool_in_use
        assert gauge.collect()[0].samples[0].value == 1


def test_metrics_are_logged_at_debug_only(
    client: FlaskClient, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="petstore.access"):
        client.get("/metrics")
        client.get("/v1/pets")
    paths = [r.fields["path"] for r in caplog.records if r.name == "petstore.access"]
    assert paths == ["/v1/pets"]


def test_metrics_dir_given_after_import_is_refused(database_url: str, tmp_path: Path) -> None:
    """prometheus_client chose its mode on import, from the environment: a later setting cannot."""
    with pytest.raises(ConfigError, match="before the service starts"):
        create_app({"DATABASE_URL": database_url, "METRICS_DIR": str(tmp_path)})


def test_observe_request_is_a_plain_function(app: Flask, api_key: str) -> None:
    """What the request pipeline calls: counts one request, returns the response unchanged."""
    response: Any = app.response_class("[]", status=200)
    with app.test_request_context("/v1/pets"):
        assert metrics.observe_request(response) is response
    with app.test_client() as client:
        assert requests_of(scrape(client), "listPets", 200) == 1


def test_a_flushed_tally_reads_as_the_same_observations() -> None:
    """The tally's bucket arithmetic agrees with Histogram.observe(), bounds included."""
    tallied = metrics.build({"pets.list_pets": "listPets"})
    reference = Histogram(
        "petstore_http_request_duration_seconds",
        "reference",
        ["operation"],
        buckets=metrics.LATENCY_BUCKETS,
        registry=None,
    )
    seconds = [0.0005, 0.001, 0.0010001, 0.004, 0.05, 0.0500001, 3.0, 12.0, 0.02, 0.02]
    for value in seconds:
        tallied.tally.add("pets.list_pets", 200, value)
        reference.labels(operation="listPets").observe(value)
    tallied.flush()

    def listed(histogram: Histogram) -> dict[tuple[str, str], float]:
        return {
            (sample.name, sample.labels.get("le", "")): sample.value
            for family in histogram.collect()
            for sample in family.samples
            if sample.labels["operation"] == "listPets" and not sample.name.endswith("_created")
        }

    assert listed(tallied.latency) == listed(reference)
    assert value_of(tallied.requests, operation="listPets", status="200") == len(seconds)


def value_of(counter: Counter, **labels: str) -> float:
    return next(
        sample.value
        for family in counter.collect()
        for sample in family.samples
        if sample.labels == labels and sample.name.endswith("_total")
    )


@pytest.mark.parametrize(
    ("peer", "forwarded_for", "status"),
    [
        pytest.param("10.1.2.3", None, 200, id="allowed-network"),
        pytest.param("127.0.0.1", None, 200, id="allowed-address"),
        pytest.param("::ffff:10.9.9.9", None, 200, id="ipv4-mapped"),
        pytest.param("fd00::5", None, 200, id="allowed-ipv6"),
        pytest.param("192.0.2.7", None, 404, id="other-network"),
        pytest.param("2001:db8::1", None, 404, id="other-ipv6"),
        # Behind PETSTORE_PROXY_COUNT the header names the client; the peer decides here.
        pytest.param("192.0.2.7", "10.1.2.3", 404, id="forged-forwarded-for"),
    ],
)
def test_metrics_allow_list_answers_others_404(
    make_app: Callable[..., Flask], peer: str, forwarded_for: str | None, status: int
) -> None:
    client = make_app(
        METRICS_ALLOW=config.from_environ(
            {"PETSTORE_METRICS_ALLOW": "10.0.0.0/8, 127.0.0.1,fd00::/8"}
        )["METRICS_ALLOW"],
        PROXY_COUNT=1,
    ).test_client()
    headers = {"X-Forwarded-For": forwarded_for} if forwarded_for else {}

    response = client.get("/metrics", headers=headers, environ_base={"REMOTE_ADDR": peer})

    if status == 404:
        assert_error(response, 404, "not_found")
        assert "petstore_" not in response.get_data(as_text=True)
    else:
        assert response.status_code == 200
        assert "petstore_http_requests_total" in response.get_data(as_text=True)


def test_metrics_without_allow_list_answer_anyone(make_app: Callable[..., Flask]) -> None:
    """The default: whoever reaches the app's port scrapes (nginx refuses /metrics itself)."""
    client = make_app().test_client()
    for peer in ("192.0.2.7", "2001:db8::1", "10.1.2.3"):
        response = client.get("/metrics", environ_base={"REMOTE_ADDR": peer})
        assert response.status_code == 200, peer


@pytest.mark.parametrize("text", ["10.0.0.0/33", "localhost", "10.0.0.1/8"])
def test_metrics_allow_list_refuses_what_is_no_network(text: str) -> None:
    with pytest.raises(ConfigError, match="PETSTORE_METRICS_ALLOW=.*CIDR"):
        config.from_environ({"PETSTORE_METRICS_ALLOW": text})


def test_a_worker_boots_beside_one_whose_file_is_still_empty(tmp_path: Path) -> None:
    """Workers boot at once: one may find another's metrics file created but not yet written."""
    empty = tmp_path / "counter_4242.db"
    empty.write_bytes(b"")
    written = MmapedDict(str(tmp_path / "counter_4343.db"))
    key = mmap_key("petstore_bans", "petstore_bans_total", [], [], "Bans.")
    written.write_value(key, 3.0, 0.0)
    written.close()

    registry = metrics.build({}).registry
    MultiProcessCollector(registry, path=str(tmp_path))
    empty.unlink()  # that worker has written its file by the first scrape

    assert registry.get_sample_value("petstore_bans_total") == 3.0

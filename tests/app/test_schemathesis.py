"""Schemathesis against the app in-process (WSGI): every operation conforms to /v1/openapi.json, all checks on."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import schemathesis
from flask import Flask
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from petstore import config, openapi, views

# Budgets so large that the limiter never answers 429 during a run: the per-key one of the
# enterprise key, and the per-IP one that requests without a key (and ignored_auth's probes) spend.
HUGE = 10**9
UNLIMITED_IP = f"{HUGE}/minute;{HUGE}/day"

pytestmark = pytest.mark.filterwarnings(
    # Raised from inside schemathesis's own strategies; nothing this suite can change.
    "ignore::hypothesis.errors.HypothesisDeprecationWarning"
)


def fuzz_config(max_examples: int) -> SchemathesisConfig:
    """Every check, positive and negative data, bounded examples, a fixed seed, no example database."""
    return SchemathesisConfig.from_dict(
        {
            "seed": 20301205,
            "generation": {"mode": "all", "max-examples": max_examples, "database": "none"},
            "checks": {"enabled": True},
            "operations": [
                {
                    # The specification describes nothing of orders, so the service answers 501
                    # on purpose, and the document says so. Any other 5xx is still a failure.
                    "include-operation-id": "listOrders",
                    "checks": {
                        "not_a_server_error": {"expected-statuses": ["2xx", "3xx", "4xx", "501"]}
                    },
                },
                {
                    # A range longer than 90 days (7 of hours), or reversed, is a 400 that no JSON
                    # Schema of two separate dates can express; the description says it.
                    "include-operation-id": "getUsage",
                    "checks": {
                        "positive_data_acceptance": {
                            "expected-statuses": ["2xx", "400", "401", "403", "404", "409", "429"]
                        }
                    },
                },
            ],
        }
    )


# The document as `petstore openapi` prints it; every app under test must serve exactly this.
# Each schema gets a copy of its own: schemathesis may rewrite the dict it is given.
DOCUMENT = openapi.to_json(openapi.build_document(config.from_environ(), views.RESOURCES))
with_key = schemathesis.openapi.from_dict(json.loads(DOCUMENT), config=fuzz_config(100))
without_key = schemathesis.openapi.from_dict(json.loads(DOCUMENT), config=fuzz_config(20))


class EnterpriseKey:
    """The current test's enterprise key, given to schemathesis as the bearer auth, so that its
    auth checks (ignored_auth) know which header is the credential and probe without it."""

    current: str | None = None

    def get(self, case: schemathesis.Case, ctx: Any) -> str:
        """The key the `enterprise_key` fixture issued for this test (none yet while collecting)."""
        return EnterpriseKey.current or "no key outside the enterprise_key fixture"

    def set(self, case: schemathesis.Case, data: str, ctx: Any) -> None:
        """Send it as `Authorization: Bearer <key>`."""
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


# No caching: every test issues its own key (the tables are emptied between tests).
with_key.auth(refresh_interval=None, retry_on=[])(EnterpriseKey)


def served(app: Flask) -> Flask:
    """The app, once it is shown to serve the document being fuzzed."""
    response = app.test_client().get("/v1/openapi.json")
    assert response.get_data(as_text=True) == DOCUMENT
    return app


def bind(case: schemathesis.Case, app: Flask) -> None:
    """Send the case, and the probes some checks derive from it, to `app` in-process."""
    case.operation.app = app
    case.operation.schema.app = app


@pytest.fixture
def app_without_ip_limit(make_app: Callable[..., Flask]) -> Flask:
    """An app whose per-IP budget (requests without a valid key) never runs out."""
    return served(make_app(IP_LIMITS=UNLIMITED_IP))


@pytest.fixture
def enterprise_key(issue_key: Callable[..., str]) -> Iterator[str]:
    """An enterprise key whose budget never runs out, used as the bearer auth of `with_key`."""
    EnterpriseKey.current = issue_key("enterprise", per_minute=HUGE, per_day=HUGE)
    yield EnterpriseKey.current
    EnterpriseKey.current = None


# The fixtures live for all the examples of one operation, on purpose: the examples share one
# app and one key as a client shares a server, and the tables are emptied per operation.
PER_OPERATION = settings(suppress_health_check=[HealthCheck.function_scoped_fixture], deadline=None)


@with_key.parametrize()
@PER_OPERATION
def test_conforms_with_a_key(
    case: schemathesis.Case, app_without_ip_limit: Flask, enterprise_key: str
) -> None:
    """Statuses, content types, bodies and headers as documented; bad data refused, good data accepted."""
    bind(case, app_without_ip_limit)
    case.call_and_validate()


@without_key.parametrize()
@PER_OPERATION
def test_without_a_key_everything_is_401(
    case: schemathesis.Case, app_without_ip_limit: Flask
) -> None:
    """Without a key every operation answers 401, an Error with the documented headers."""
    bind(case, app_without_ip_limit)
    response = case.call_and_validate()
    assert response.status_code == 401, response.text


def test_stateful_create_then_get(app_without_ip_limit: Flask, enterprise_key: str) -> None:
    """Sequences along the document's links (createPet -> getPet): what was created can be fetched."""
    with_key.app = app_without_ip_limit
    try:
        Workflow = with_key.as_state_machine()
        Workflow.run(
            settings=settings(
                max_examples=25,
                stateful_step_count=5,
                deadline=None,
                suppress_health_check=list(HealthCheck),
                database=None,
            )
        )
    finally:
        with_key.app = None

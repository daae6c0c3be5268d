"""A real consumer: a Python client generated (openapi-python-client) from the served /v1/openapi.json."""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import requests

from petstore import db
from tests.support.servers import Gunicorn

GENERATOR = Path(sys.executable).parent / "openapi-python-client"
PACKAGE = "animal_store_client"
# No post hooks: the generator would run ruff over the code, which a consumer need not have.
GENERATOR_CONFIG = f"""\
project_name_override: animal-store-client
package_name_override: {PACKAGE}
post_hooks: []
"""


@pytest.fixture
def server(database_url: str, conn: db.Connection, tmp_path: Path) -> Iterator[Gunicorn]:
    """The app under gunicorn (one worker, in-memory limiter) on a free loopback port, tables emptied."""
    environ = {"DATABASE_URL": database_url, "RATELIMIT_STORAGE_URI": "memory://"}
    with Gunicorn(environ, tmp_path / "gunicorn.log", workers=1, threads=4) as running:
        yield running


@pytest.fixture
def client_package(server: Gunicorn, tmp_path: Path) -> Iterator[ModuleType]:
    """Generate the client from what the server serves, into tmp_path, and import it."""
    response = requests.get(f"{server.url}/v1/openapi.json", timeout=10)
    assert response.status_code == 200, response.text
    document = tmp_path / "openapi.json"
    document.write_bytes(response.content)
    config = tmp_path / "generator.yaml"
    config.write_text(GENERATOR_CONFIG, encoding="utf-8")
    generated = subprocess.run(
        [
            str(GENERATOR),
            "generate",
            "--path",
            str(document),
            "--config",
            str(config),
            "--meta",
            "none",
            "--output-path",
            str(tmp_path / "generated" / PACKAGE),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generated.returncode == 0, generated.stdout + generated.stderr
    # The generator reports what it could not translate as warnings; there must be none.
    assert "Warning" not in generated.stdout + generated.stderr, generated.stdout + generated.stderr
    # Imported from where it was written, as a package, leaving the import path as it is.
    package_dir = tmp_path / "generated" / PACKAGE
    spec = importlib.util.spec_from_file_location(
        PACKAGE, package_dir / "__init__.py", submodule_search_locations=[str(package_dir)]
    )
    assert spec is not None and spec.loader is not None
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    try:
        spec.loader.exec_module(package)
        yield package
    finally:
        for name in [name for name in sys.modules if name.split(".")[0] == PACKAGE]:
            del sys.modules[name]


def generated(module: str) -> ModuleType:
    """A module of the generated package (imported by the client_package fixture): "models", say."""
    return importlib.import_module(f"{PACKAGE}.{module}")


def authenticated(package: ModuleType, server: Gunicorn, key: str) -> Any:
    """The generated client for the server's /v1 with `key`; an undocumented status raises."""
    return package.AuthenticatedClient(
        base_url=f"{server.url}/v1", token=key, raise_on_unexpected_status=True
    )


def test_create_list_and_fetch_with_the_generated_client(
    client_package: ModuleType, server: Gunicorn, issue_key: Callable[..., str]
) -> None:
    create_pet = generated("api.pets.create_pet")
    list_pets = generated("api.pets.list_pets")
    get_pet = generated("api.pets.get_pet")
    models = generated("models")

    client = authenticated(client_package, server, issue_key("free"))
    with client:
        new_pet = models.NewPet(name="Rex", category_id=7, status=models.NewPetStatus.AVAILABLE)
        created = create_pet.sync_detailed(
            client=client, body=new_pet, idempotency_key="generated-client-1"
        )
        assert created.status_code == 201, created.content
        pet = created.parsed
        assert isinstance(pet, models.Pet)
        assert (pet.name, pet.category_id, pet.status) == ("Rex", 7, models.PetStatus.AVAILABLE)
        assert created.headers["Location"] == f"/v1/pets/{pet.id}"

        # A retry with the same Idempotency-Key gets the same pet back, not a second one.
        retried = create_pet.sync_detailed(
            client=client, body=new_pet, idempotency_key="generated-client-1"
        )
        assert retried.status_code == 201
        assert retried.parsed.id == pet.id

        second = create_pet.sync(client=client, body=models.NewPet(name="Tom", category_id=8))
        assert isinstance(second, models.Pet)
        assert not second.to_dict().get("status")  # never stated, so left out

        page = list_pets.sync(client=client, limit=1)
        assert [p.id for p in page] == [pet.id]
        listed = list_pets.sync_detailed(client=client, limit=1)
        assert listed.headers["Link"] == f'</v1/pets?limit=1&after={pet.id}>; rel="next"'
        rest = list_pets.sync(client=client, limit=1, after=pet.id)
        assert [p.id for p in rest] == [second.id]
        available = list_pets.sync(client=client, status=models.ListPetsStatus.AVAILABLE)
        assert [p.name for p in available] == ["Rex"]

        fetched = get_pet.sync_detailed(pet.id, client=client)
        assert fetched.status_code == 200
        assert fetched.parsed.to_dict() == pet.to_dict()
        assert fetched.headers["Sunset"] == "Thu, 05 Dec 2030 00:00:00 GMT"

        missing = get_pet.sync(second.id + 1000, client=client)
        assert isinstance(missing, models.Error)
        assert (missing.code, missing.status) == ("not_found", 404)

    anonymous = client_package.Client(base_url=f"{server.url}/v1", raise_on_unexpected_status=True)
    with anonymous:
        refused = list_pets.sync(client=anonymous)
        assert isinstance(refused, models.Error)
        assert (refused.code, refused.status) == ("unauthorized", 401)


def test_rate_limit_and_scopes_with_the_generated_client(
    client_package: ModuleType, server: Gunicorn, issue_key: Callable[..., str], conn: db.Connection
) -> None:
    get_rate_limit = generated("api.rate_limits.get_rate_limit")
    create_pet = generated("api.pets.create_pet")
    list_pets = generated("api.pets.list_pets")
    models = generated("models")
    read_only = issue_key("pro")
    conn.execute("update api_keys set scopes = '{read}'")

    client = authenticated(client_package, server, read_only)
    with client:
        assert list_pets.sync(client=client) == []
        refused = create_pet.sync_detailed(
            client=client, body=models.NewPet(name="Rex", category_id=1)
        )
        assert refused.status_code == 403
        assert isinstance(refused.parsed, models.Error)
        assert refused.parsed.code == "insufficient_scope"

        standing = get_rate_limit.sync(client=client)
        assert isinstance(standing, models.RateLimit)
        assert standing.plan == "pro"
        minute = standing.limits["minute"]
        assert (minute.limit, minute.remaining, minute.used) == (300, 298, 2)
        assert standing.limits["day"].limit == 10_000
        assert standing.ban is None
        assert (standing.strikes.count, standing.strikes.threshold) == (0, 10)


def test_usage_with_the_generated_client(
    client_package: ModuleType, server: Gunicorn, issue_key: Callable[..., str]
) -> None:
    """getUsage: the key's own requests, in their bucket within 10 s (the workers' batches)."""
    get_usage = generated("api.usage.get_usage")
    list_pets = generated("api.pets.list_pets")
    models = generated("models")
    client = authenticated(client_package, server, issue_key("free"))
    with client:
        assert list_pets.sync(client=client) == []
        deadline = time.monotonic() + 10
        while True:
            usage = get_usage.sync(client=client, granularity=models.GetUsageGranularity.HOUR)
            assert isinstance(usage, models.Usage)
            if usage.usage:
                break
            assert time.monotonic() < deadline, "the request is not in its bucket after 10 s"
            time.sleep(0.2)
        assert usage.granularity == "hour"
        [bucket] = usage.usage
        assert bucket.to_dict()["outcomes"]["2xx"] >= 1
        assert bucket.requests == sum(bucket.to_dict()["outcomes"].values())

        refused = get_usage.sync_detailed(
            client=client, from_=datetime.date(2026, 11, 26), to=datetime.date(2026, 11, 25)
        )
        assert refused.status_code == 400
        assert isinstance(refused.parsed, models.Error)
        assert refused.parsed.code == "invalid_request"

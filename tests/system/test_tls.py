"""HTTPS and HTTP/2 at the shipped nginx site, with a certificate of the test's own CA.

curl (HTTP/2 by ALPN) and Python's ssl talk to Debian's nginx running deploy/nginx/petstore.conf
in front of one gunicorn: h2 is negotiated, TLS 1.1 is refused, HSTS comes over HTTPS only,
the Location and Link the app answers lead somewhere over HTTPS, and nginx's own refusals are
the Error JSON over HTTP/2 too (HTTP/1.1 in TLS: tests/system/test_refusals.py).
"""

from __future__ import annotations

import json
import socket
import ssl
import subprocess
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from petstore import db
from tests.support.checks import Answer, assert_error
from tests.support.nginx import Deployment, deploy
from tests.support.programs import program

ENVIRON = {"PETSTORE_PROXY_COUNT": "1", "RATELIMIT_STORAGE_URI": "memory://"}
HSTS = "max-age=63072000"
CURL_HINT = "curl with HTTP/2 (`curl -V` lists HTTP2): run .ci/install-nginx"


@pytest.fixture(scope="module")
def deployment(database_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    """One instance (one worker: memory:// counts in one process) behind nginx, for the module."""
    with deploy(
        {"DATABASE_URL": database_url, **ENVIRON},
        tmp_path_factory.mktemp("tls"),
        instances=1,
        workers=1,
        nginx_workers=1,
    ) as running:
        yield running


@pytest.fixture
def key(issue_key: Callable[..., str], conn: db.Connection) -> str:
    """An enterprise key on empty tables."""
    return issue_key("enterprise", per_minute=1000, per_day=10000)


@dataclass
class CurlAnswer:
    """What curl got: the HTTP version it spoke, and the answer."""

    version: str
    answer: Answer


def curl(deployment: Deployment, url: str, *args: str, stdin: bytes = b"") -> CurlAnswer:
    """One request with curl, trusting only the test CA; its HTTP version and answer."""
    curl_path = program("curl")
    if (
        "HTTP2"
        not in subprocess.run(
            [curl_path, "-V"], capture_output=True, text=True, timeout=10
        ).stdout.split("Features:")[-1]
    ):
        pytest.skip(f"no {CURL_HINT}")
    certificate = deployment.nginx.certificate
    assert certificate is not None
    done = subprocess.run(
        [curl_path, "-sS", "--cacert", str(certificate.ca), "--max-time", "10", "-D", "-"]
        + ["-o", "/dev/stdout", "-w", "\n%{http_version}", *args, url],
        input=stdin,
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    output, _, version = done.stdout.rpartition(b"\n")
    head, _, body = output.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = [
        (name.strip(), value.strip()) for name, _, value in (h.partition(":") for h in lines)
    ]
    parsed: Any = json.loads(body) if body.strip() else None
    status = int(status_line.split()[1])
    return CurlAnswer(version.decode(), Answer.of("", url, status, parsed, headers, elapsed=0.0))


def test_https_negotiates_http2_and_sends_hsts(deployment: Deployment, key: str) -> None:
    got = curl(
        deployment,
        f"{deployment.nginx.tls_url}/v1/pets",
        "--http2",
        "-H",
        f"Authorization: Bearer {key}",
    )

    assert got.version == "2"
    assert got.answer.status == 200, got.answer
    assert got.answer.body == []
    assert got.answer.headers["strict-transport-security"] == HSTS


@pytest.mark.parametrize("version", ["1.1", "2"])
def test_hsts_only_over_https(deployment: Deployment, key: str, version: str) -> None:
    """Over plain HTTP (port 80, a load balancer's TLS in front) nginx sends no HSTS."""
    flag = "--http2" if version == "2" else "--http1.1"
    bearer = f"Authorization: Bearer {key}"
    secure = curl(deployment, f"{deployment.nginx.tls_url}/v1/pets", flag, "-H", bearer)
    plain = curl(deployment, f"{deployment.url}/v1/pets", "--http1.1", "-H", bearer)

    assert secure.version == version
    assert (secure.answer.status, plain.answer.status) == (200, 200)
    assert secure.answer.headers["strict-transport-security"] == HSTS
    assert "strict-transport-security" not in plain.answer.headers


def handshake(deployment: Deployment, version: ssl.TLSVersion) -> str:
    """A TLS handshake with nginx at exactly `version`; the version agreed."""
    certificate = deployment.nginx.certificate
    assert certificate is not None
    context = certificate.context()
    with warnings.catch_warnings():  # TLS 1.0 and 1.1 are deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        context.minimum_version = context.maximum_version = version
    # Let this client offer what OpenSSL's default security level forbids: the refusal must
    # then be the server's.
    context.set_ciphers("DEFAULT:@SECLEVEL=0")
    with (
        socket.create_connection(("127.0.0.1", deployment.nginx.tls_port), timeout=10) as sock,
        context.wrap_socket(sock, server_hostname="127.0.0.1") as tls,
    ):
        return str(tls.version())


@pytest.mark.parametrize(
    ("version", "agreed"),
    [(ssl.TLSVersion.TLSv1_2, "TLSv1.2"), (ssl.TLSVersion.TLSv1_3, "TLSv1.3")],
    ids=["TLSv1.2", "TLSv1.3"],
)
def test_tls_12_and_13_are_accepted(
    deployment: Deployment, version: ssl.TLSVersion, agreed: str
) -> None:
    assert handshake(deployment, version) == agreed


@pytest.mark.parametrize(
    "version", [ssl.TLSVersion.TLSv1, ssl.TLSVersion.TLSv1_1], ids=["TLSv1.0", "TLSv1.1"]
)
def test_tls_below_12_is_refused_by_the_server(
    deployment: Deployment, version: ssl.TLSVersion
) -> None:
    with pytest.raises(ssl.SSLError) as refused:
        handshake(deployment, version)
    # nginx's alert, not this client declining to offer the version.
    assert "PROTOCOL_VERSION" in str(refused.value).upper(), refused.value


@pytest.mark.parametrize("version", ["1.1", "2"])
def test_location_and_link_lead_somewhere_over_https(
    deployment: Deployment, key: str, version: str
) -> None:
    """The app's Location and Link are paths: over HTTPS they name HTTPS resources."""
    flag = "--http2" if version == "2" else "--http1.1"
    base = deployment.nginx.tls_url
    bearer = ("-H", f"Authorization: Bearer {key}")
    pet = ("-H", "Content-Type: application/json", "--data-binary", '{"name":"Rex","categoryId":1}')
    for _ in range(2):
        created = curl(deployment, f"{base}/v1/pets", flag, *bearer, *pet)
        assert created.answer.status == 201, created.answer
    page = curl(deployment, f"{base}/v1/pets?limit=1", flag, *bearer)

    location = created.answer.headers["location"]
    link = page.answer.headers["link"]
    assert location == "/v1/pets/2"
    assert link == '</v1/pets?limit=1&after=1>; rel="next"'
    fetched = curl(deployment, f"{base}{location}", flag, *bearer)
    following = curl(deployment, base + link.partition(">")[0].removeprefix("<"), flag, *bearer)
    assert fetched.answer.status == 200 and fetched.answer.body["name"] == "Rex"
    assert following.answer.status == 200 and [p["id"] for p in following.answer.body] == [2]
    assert {created.version, page.version, fetched.version, following.version} == {version}


TOO_BIG = b"{" + b" " * 20000 + b"}"
# nginx's own refusals, as an HTTP/2 client can send them: (curl arguments, status, code).
HTTP2_REFUSALS = {
    "trace": (["-X", "TRACE"], "/v1/pets", 405, "method_not_allowed"),
    "uri-too-long": ([], "/v1/pets?status=" + "a" * 9000, 414, "uri_too_long"),
    "header-line-too-long": (["-H", "X-Big: " + "a" * 9000], "/v1/pets", 431, "headers_too_large"),
    "too-many-fields": (
        [arg for n in range(200) for arg in ("-H", f"X-Field-{n}: {n}")],
        "/v1/pets",
        431,
        "headers_too_large",
    ),
    "body-too-large": (
        ["-H", "Content-Type: application/json", "--data-binary", "@-"],
        "/v1/pets",
        413,
        "payload_too_large",
    ),
    # No Content-Length: nginx counts the DATA frames as they come.
    "body-too-large-unknown-length": (
        ["-H", "Content-Type: application/json", "-T", "-", "-X", "POST"],
        "/v1/pets",
        413,
        "payload_too_large",
    ),
    "metrics": ([], "/metrics", 404, "not_found"),
}


@pytest.mark.parametrize(
    ("args", "path", "status", "code"), HTTP2_REFUSALS.values(), ids=HTTP2_REFUSALS.keys()
)
def test_refusals_over_http2_are_the_error_json(
    deployment: Deployment,
    key: str,
    conn: db.Connection,
    args: list[str],
    path: str,
    status: int,
    code: str,
) -> None:
    """Each as the HTTP/1.1 tests send it: the Error JSON (never nginx's HTML), with HSTS."""
    got = curl(
        deployment,
        deployment.nginx.tls_url + path,
        "--http2",
        "-H",
        f"Authorization: Bearer {key}",
        *args,
        stdin=TOO_BIG,
    )

    assert got.version == "2"
    assert_error(got.answer, status, code)
    assert got.answer.headers["strict-transport-security"] == HSTS
    assert conn.execute("select count(*) as n from pets").fetchone() == {"n": 0}


def test_an_unknown_acme_challenge_is_nginx_own_404(deployment: Deployment) -> None:
    """certbot's webroot path is nginx's: no file there is the 404 Error JSON, no app involved."""
    got = curl(deployment, f"{deployment.url}/.well-known/acme-challenge/token", "--http1.1")

    assert_error(got.answer, 404, "not_found")
    request_id = got.answer.headers["x-request-id"]
    assert deployment.nginx.logged([request_id])[request_id]["upstream"] == ""


def test_plain_http_to_the_https_port_is_a_400(deployment: Deployment) -> None:
    """nginx's 497: the 400 Error JSON, not its HTML page."""
    got = curl(deployment, f"http://127.0.0.1:{deployment.nginx.tls_port}/v1/pets", "--http1.1")

    assert_error(got.answer, 400, "invalid_request")
    assert "strict-transport-security" not in got.answer.headers


def test_the_site_keeps_one_plain_listener_and_one_certificate(tmp_path: Path) -> None:
    """The shipped file itself: one `listen 80;`, one HTTPS listener, the certificate's paths once."""
    site = (Path(__file__).resolve().parents[2] / "deploy" / "nginx" / "petstore.conf").read_text()
    lines = [line.strip() for line in site.splitlines() if not line.strip().startswith("#")]

    assert lines.count("listen 80;") == 1
    assert lines.count("listen 443 ssl http2;") == 1
    assert [line for line in lines if "/etc/petstore/tls/" in line] == [
        "ssl_certificate /etc/petstore/tls/fullchain.pem;",
        "ssl_certificate_key /etc/petstore/tls/privkey.pem;",
    ]
    assert "ssl_protocols TLSv1.2 TLSv1.3;" in lines

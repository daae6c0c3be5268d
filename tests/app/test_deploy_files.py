"""deploy/: nginx's error pages are Error JSON, nginx and gunicorn share limits and words; Patroni's timings."""

from __future__ import annotations

import json
import re
import runpy
from pathlib import Path
from typing import Any

import gunicorn.util
import pytest
from flask import Flask

from petstore import errors, gunicorn_glue

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SITE = (DEPLOY / "nginx" / "petstore.conf").read_text(encoding="utf-8")
ERROR_PAGE = re.compile(r"^\s*error_page\s+([\d ]+?)\s+(?:=(\d+)\s+)?(/_nginx/\w+);", re.M)
PAGE = re.compile(r"location = (/_nginx/\w+) \{[^}]*?return (\d+) '([^']*)';", re.S)
# Every status nginx itself can answer with in front of the app (docs/deploying.rst):
# request-line and header errors, TRACE, body and URI too large, heads too large, TLS errors, an
# unknown transfer coding, HTTP/2+ on the wire as text, its own failures, no upstream.
NGINX_STATUSES = {400, 405, 413, 414, 494, 495, 496, 497, 500, 501, 502, 503, 504, 505}


def error_pages() -> dict[int, tuple[int | None, str]]:
    """status -> (the status it is answered with if `=N` says, the page's URI)."""
    pages: dict[int, tuple[int | None, str]] = {}
    for statuses, override, uri in ERROR_PAGE.findall(SITE):
        for status in statuses.split():
            pages[int(status)] = (int(override) if override else None, uri)
    return pages


def page_texts() -> dict[str, tuple[int, str]]:
    """page URI -> (the status its `return` answers, the body nginx sends: its \\n a newline)."""
    return {
        uri: (int(status), body.replace("\\n", "\n")) for uri, status, body in PAGE.findall(SITE)
    }


def page_bodies() -> dict[str, tuple[int, dict[str, Any]]]:
    """page URI -> (the status its `return` answers, its JSON body)."""
    return {uri: (status, json.loads(body)) for uri, (status, body) in page_texts().items()}


def test_nginx_writes_its_error_json_as_the_app_and_gunicorn_do(app: Flask) -> None:
    """Byte for byte one format: json.dumps' separators, a newline after the object (as Flask's
    jsonify ends its bodies)."""
    texts = {uri: body for uri, (_status, body) in page_texts().items()}
    assert texts
    assert [body for body in texts.values() if body != json.dumps(json.loads(body)) + "\n"] == []
    with app.app_context():
        made = errors.error_response(405, "method_not_allowed", errors.MESSAGES[405])
    assert texts["/_nginx/405"] == made.get_data(as_text=True)
    refused = gunicorn_glue.error_bytes(414).partition(b"\r\n\r\n")[2]
    assert texts["/_nginx/414"] == refused.decode()


def test_deploy_and_ci_files_name_only_files_that_exist() -> None:
    """A path of this repository named in a comment of deploy/ or .ci/ is a file that is there."""
    root = DEPLOY.parent
    named = {
        path
        for deployed in [*DEPLOY.rglob("*"), *(root / ".ci").iterdir()]
        # gunicorn's import of deploy/gunicorn.conf.py (make run) leaves its bytecode there.
        if deployed.is_file() and "__pycache__" not in deployed.parts
        for path in re.findall(
            r"(?<![\w/.-])((?:tests|docs|petstore|bench|deploy)/[\w./-]*\.\w+)",
            deployed.read_text(),
        )
    }
    assert named
    assert sorted(path for path in named if not (root / path).exists()) == []


def test_every_status_nginx_makes_has_a_json_page() -> None:
    assert set(error_pages()) == NGINX_STATUSES


@pytest.mark.parametrize("status", sorted(NGINX_STATUSES))
def test_each_page_is_the_error_json_of_the_status_it_answers(status: int) -> None:
    override, uri = error_pages()[status]
    returned, body = page_bodies()[uri]
    assert set(body) == {"code", "message", "status"}
    assert body["status"] == returned
    # A client's mistake is never a 5xx; nginx's 5xx of its own are 500 and 503 only.
    assert returned < 500 or returned in (500, 503)
    if override is not None:
        assert override == returned
    else:
        assert status == returned


@pytest.mark.parametrize(
    ("page", "gunicorn_status"),
    [("400", 400), ("414", 414), ("431", 431), ("500", 500), ("501", 501)],
)
def test_nginx_and_gunicorn_use_the_same_words(page: str, gunicorn_status: int) -> None:
    """A refusal reads the same whichever layer makes it."""
    returned, body = page_bodies()[f"/_nginx/{page}"]
    assert (returned, body["code"], body["message"]) == gunicorn_glue.REFUSALS[gunicorn_status]


@pytest.mark.parametrize("status", [405, 413])
def test_nginx_and_the_app_use_the_same_words(status: int) -> None:
    assert page_bodies()[f"/_nginx/{status}"][1]["message"] == errors.MESSAGES[status]


def test_nginx_and_gunicorn_share_the_head_limits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """nginx's header buffer (8 KB, with CRLF) holds exactly what gunicorn's limits let in."""
    # Loading the config calls use_json_refusals(): keep gunicorn's own write_error afterwards.
    monkeypatch.setattr(gunicorn.util, "write_error", gunicorn.util.write_error)
    monkeypatch.setenv("PETSTORE_DB_POOL_SIZE", "4")
    # The config checks every setting first; this one only needs to be there.
    monkeypatch.setenv("DATABASE_URL", "postgresql://petstore@127.0.0.1/petstore")
    # Set here so that the config's own default (a new directory) does not outlive the test.
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    settings = runpy.run_path(str(DEPLOY / "gunicorn.conf.py"))
    buffers = re.search(r"large_client_header_buffers (\d+) (\d+)k;", SITE)
    assert buffers, "no large_client_header_buffers in petstore.conf"
    line_bytes = int(buffers.group(2)) * 1024 - len("\r\n")
    assert settings["limit_request_line"] == line_bytes
    assert settings["limit_request_field_size"] == line_bytes
    assert settings["limit_request_fields"] == 100
    assert settings["secure_scheme_headers"] == {}
    assert settings["forwarder_headers"] == ""
    # gunicorn builds no access line of its own (the app logs each request).
    assert settings["accesslog"] is None
    assert (
        settings["logger_class"]
        == f"{gunicorn_glue.__name__}.{gunicorn_glue.NoAccessLogger.__name__}"
    )


def test_every_code_nginx_and_gunicorn_answer_is_in_the_table_of_codes() -> None:
    """nginx's pages and gunicorn's refusals (gunicorn_glue.REFUSALS) use ERRORS' codes and statuses."""
    used = [(body["code"], returned) for returned, body in page_bodies().values()]
    used += [(code, status) for status, code, _message in gunicorn_glue.REFUSALS.values()]
    assert used
    assert [
        (code, status) for code, status in used if errors.ERRORS.get(code, (None,))[0] != status
    ] == []


def test_patroni_timings_follow_patronis_rule_and_writes_wait_for_the_standby() -> None:
    """deploy/patroni.yml: a ttl newer Patroni accepts, loop_wait + 2 × retry_timeout within it,
    synchronous replication, and no password in the file."""
    import yaml

    text = (DEPLOY / "patroni.yml").read_text(encoding="utf-8")
    dcs = yaml.safe_load(text)["bootstrap"]["dcs"]
    assert dcs["ttl"] >= 20
    assert dcs["loop_wait"] >= 1 and dcs["retry_timeout"] >= 3
    assert dcs["loop_wait"] + 2 * dcs["retry_timeout"] <= dcs["ttl"]
    assert dcs["synchronous_mode"] is True
    assert dcs["postgresql"]["use_pg_rewind"] is True
    assert "password:" not in text


def test_haproxy_routes_writes_by_the_leader_lock_and_patroni_has_a_watchdog() -> None:
    """deploy/haproxy.cfg sends writes only to the node whose Patroni answers GET /primary (the
    leader lock) and cuts a node's sessions when it is marked down; deploy/patroni.yml arms
    Patroni's watchdog (tests/support turns it off)."""
    import yaml

    text = (DEPLOY / "haproxy.cfg").read_text(encoding="utf-8")
    primary = text[text.index("listen primary") :]
    assert "option httpchk GET /primary\n" in primary
    assert "http-check expect status 200\n" in primary
    assert "on-marked-down shutdown-sessions" in primary
    servers = [line for line in primary.splitlines() if line.strip().startswith("server ")]
    assert len(servers) >= 2
    assert all(line.endswith("check port 8008") for line in servers), servers
    watchdog = yaml.safe_load((DEPLOY / "patroni.yml").read_text(encoding="utf-8"))["watchdog"]
    assert watchdog["mode"] in ("automatic", "required")
    assert watchdog["safety_margin"] >= 1

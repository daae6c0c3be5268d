"""The deployment under test: the shipped nginx and gunicorn configs run on loopback, and a timed HTTP client."""

from __future__ import annotations

import json
import os
import re
import signal
import ssl
import subprocess
import sys
from collections.abc import Collection, Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.support.programs import program
from tests.support.servers import (
    LOOPBACK,
    Gunicorn,
    ServerFailed,
    ServerProcess,
    accepts_connections,
    free_port,
    poll_until,
)

ROOT = Path(__file__).resolve().parents[2]
SITE_CONF = ROOT / "deploy" / "nginx" / "petstore.conf"
GUNICORN_CONF = ROOT / "deploy" / "gunicorn.conf.py"

# What the shipped file says, and what the tests put in its place.
UPSTREAM_BLOCK = re.compile(r"(upstream petstore \{\n)(.*?)(\n\})", re.S)
UPSTREAM_SERVER = re.compile(r"^(\s*)server\s+\S+(.*;)$", re.M)
LISTEN = re.compile(r"^(\s*)listen\s+80;$", re.M)
TLS_LISTEN = re.compile(r"^(\s*)listen\s+443\s+ssl\s+http2;$", re.M)
CERTIFICATE = re.compile(r"^(\s*)ssl_certificate\s+/etc/petstore/tls/fullchain\.pem;$", re.M)
CERTIFICATE_KEY = re.compile(r"^(\s*)ssl_certificate_key\s+/etc/petstore/tls/privkey\.pem;$", re.M)
ACCESS_LOG = re.compile(r"^(\s*)access_log\s+/\S+\s+petstore_json;$", re.M)


def nginx_binary() -> str:
    """The nginx program; skips the test when it is missing (conftest fails skips under CI)."""
    return program("nginx")


@dataclass(frozen=True)
class Certificate:
    """A test CA and a certificate it signed for the loopback address and localhost."""

    ca: Path
    fullchain: Path
    privkey: Path

    def context(self) -> ssl.SSLContext:
        """A client's TLS context that trusts this CA only."""
        return ssl.create_default_context(cafile=str(self.ca))


def make_certificate(
    directory: Path, hosts: Sequence[str] = (LOOPBACK, "localhost")
) -> Certificate:
    """A throwaway CA and a server certificate it signs (P-256, one day), made with openssl."""
    openssl = program("openssl")
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, request, cert = (
        directory / name for name in ("ca.key", "ca.pem", "privkey.pem", "server.csr", "cert.pem")
    )
    names = ",".join(f"IP:{host}" if host[0].isdigit() else f"DNS:{host}" for host in hosts)
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes"]
    steps = [
        [openssl, "req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "1",
         "-subj", "/CN=petstore test CA"],
        [openssl, "req", *ec, "-keyout", key, "-out", request, "-subj", f"/CN={hosts[0]}"],
        [openssl, "x509", "-req", "-in", request, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "1", "-extfile", "/dev/stdin"],
    ]  # fmt: skip
    extensions = f"subjectAltName={names}\nextendedKeyUsage=serverAuth\n"
    for step in steps:
        subprocess.run(
            [str(part) for part in step],
            input=extensions if step is steps[-1] else "",
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        )
    fullchain = directory / "fullchain.pem"
    fullchain.write_text(cert.read_text() + ca.read_text())
    return Certificate(ca, fullchain, key)


def render_site(
    upstreams: Sequence[str],
    listen: str,
    access_log: Path,
    tls_listen: str,
    certificate: Certificate,
) -> str:
    """deploy/nginx/petstore.conf with these upstream addresses, listen addresses (plain and
    HTTPS), certificate and access log."""
    text = SITE_CONF.read_text(encoding="utf-8")
    block = UPSTREAM_BLOCK.search(text)
    assert block, f"no `upstream petstore {{...}}` block in {SITE_CONF}"
    servers = UPSTREAM_SERVER.findall(block.group(2))
    assert servers, f"no `server` line in the upstream block of {SITE_CONF}"
    indent, parameters = servers[0]
    ours = [f"{indent}server {address}{parameters}" for address in upstreams]
    lines = block.group(2).split("\n")
    first = next(n for n, line in enumerate(lines) if UPSTREAM_SERVER.match(line))
    rest = [line for line in lines[first:] if not UPSTREAM_SERVER.match(line)]
    body = "\n".join([*lines[:first], *ours, *rest])
    text = text[: block.start(2)] + body + text[block.end(2) :]
    text, listens = LISTEN.subn(rf"\g<1>listen {listen};", text)
    assert listens == 1, f"expected one `listen 80;` in {SITE_CONF}"
    for pattern, line in (
        (TLS_LISTEN, f"listen {tls_listen} ssl http2;"),
        (CERTIFICATE, f"ssl_certificate {certificate.fullchain};"),
        (CERTIFICATE_KEY, f"ssl_certificate_key {certificate.privkey};"),
    ):
        text, found = pattern.subn(rf"\g<1>{line}", text)
        assert found == 1, f"expected one line like `{line.split()[0]} ...` in {SITE_CONF}"
    text, logs = ACCESS_LOG.subn(rf"\g<1>access_log {access_log} petstore_json;", text)
    assert logs == 1, f"expected one `access_log /... petstore_json;` in {SITE_CONF}"
    return text


def render_main(prefix: Path, site: Path, workers: int) -> str:
    """A minimal nginx.conf around the site, like Debian's `http { include conf.d/*.conf; }`."""
    # As root the workers would run as nobody, who cannot enter pytest's private temp dirs.
    user = "user root;\n" if os.geteuid() == 0 else ""
    temp = prefix / "temp"
    return (
        f"{user}worker_processes {workers};\n"
        f"pid {prefix / 'nginx.pid'};\n"
        f"error_log {prefix / 'error.log'} warn;\n"
        "events { worker_connections 512; }\n"
        "http {\n"
        f"    client_body_temp_path {temp / 'body'};\n"
        f"    proxy_temp_path {temp / 'proxy'};\n"
        f"    fastcgi_temp_path {temp / 'fastcgi'};\n"
        f"    uwsgi_temp_path {temp / 'uwsgi'};\n"
        f"    scgi_temp_path {temp / 'scgi'};\n"
        f"    include {site};\n"
        "}\n"
    )


class Nginx(ServerProcess):
    """nginx with the shipped site in front of `upstreams`, on a free loopback port, as a context manager."""

    name = "nginx"
    ready = "listen"
    stop_signal = signal.SIGQUIT  # graceful
    # Its output goes where nginx itself sends its stderr once it has read the config.
    log_mode = "ab"
    poll_interval = 0.05

    def __init__(
        self,
        upstreams: Sequence[str],
        prefix: Path,
        *,
        workers: int = 2,
        host: str = LOOPBACK,
        netns: str | None = None,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            prefix / "error.log", start_timeout=start_timeout, stop_timeout=stop_timeout
        )
        self.upstreams = list(upstreams)
        self.prefix = prefix
        self.workers = workers
        # Another host (a network namespace of the test's) listens on its own address.
        self.host = host
        self.netns = netns
        self.url = f"http://{host}:{self.port}"
        # The HTTPS listener, with HTTP/2, and its certificate (made when the config is written).
        self.tls_port = free_port()
        self.tls_url = f"https://{host}:{self.tls_port}"
        self.certificate: Certificate | None = None
        self.access_log_path = prefix / "access.log"
        self.error_log_path = self.log_path

    def write_config(self) -> Path:
        """Render the site and the main config into the prefix; the main config's path."""
        (self.prefix / "temp").mkdir(parents=True, exist_ok=True)
        site = self.prefix / "petstore.conf"
        if self.certificate is None:
            self.certificate = make_certificate(self.prefix / "tls", (self.host, "localhost"))
        site.write_text(
            render_site(
                self.upstreams,
                f"{self.host}:{self.port}",
                self.access_log_path,
                f"{self.host}:{self.tls_port}",
                self.certificate,
            ),
            encoding="utf-8",
        )
        main = self.prefix / "nginx.conf"
        main.write_text(render_main(self.prefix, site, self.workers), encoding="utf-8")
        return main

    def command(self, main: Path, *extra: str) -> list[str]:
        """nginx with our prefix, config and error log (never the system's)."""
        return [
            nginx_binary(),
            "-p",
            f"{self.prefix}/",
            "-c",
            str(main),
            "-e",
            str(self.error_log_path),
            *extra,
        ]

    def start(self) -> None:
        """Check the config with `nginx -t`, start nginx in the foreground, wait (bounded) for its port."""
        main = self.write_config()
        test = self.command(main, "-t")
        if self.netns is not None:  # `nginx -t` binds the listen address too
            test = [program("ip"), "netns", "exec", self.netns, *test]
        check = subprocess.run(test, capture_output=True, text=True, timeout=self.start_timeout)
        if check.returncode != 0:
            raise ServerFailed(f"nginx -t refused the rendered config:\n{check.stderr}")
        self.launch(self.command(main, "-g", "daemon off;"))

    def answers(self) -> bool:
        """Whether its port takes connections right now."""
        return accepts_connections(self.port, self.host)

    def access_log(self) -> list[dict[str, Any]]:
        """nginx's access log, one JSON object per line (the petstore_json format)."""
        if not self.access_log_path.exists():
            return []
        lines = self.access_log_path.read_text(encoding="utf-8").splitlines()
        return [json.loads(line) for line in lines if line.strip()]

    def logged(
        self, request_ids: Collection[str], within: float = 5.0
    ) -> dict[str, dict[str, Any]]:
        """request id -> nginx's access log entry of these requests, waiting (bounded) for the last.

        nginx writes a line after it sent the answer, so a client may read the log before.
        """
        wanted = set(request_ids)
        return poll_until(
            lambda: {e["request_id"]: e for e in self.access_log() if e["request_id"] in wanted},
            lambda found: len(found) == len(wanted),
            within,
        )

    def error_log(self) -> str:
        """The tail of nginx's error log, for assertion messages."""
        return self.log()


class DeployedGunicorn(Gunicorn):
    """gunicorn as deployed: `gunicorn -c deploy/gunicorn.conf.py wsgi:app`, set up by the environment.

    `app` serves another app the same way (bench/'s floors), and `tree` another checkout (a
    baseline build): gunicorn reads the config and imports the app from there.
    """

    def __init__(
        self,
        environ: Mapping[str, str],
        log_path: Path,
        *,
        workers: int = 2,
        threads: int = 2,
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
        app: Sequence[str] = ("wsgi:app",),
        tree: Path = ROOT,
    ) -> None:
        super().__init__(
            environ,
            log_path,
            workers=workers,
            threads=threads,
            start_timeout=start_timeout,
            stop_timeout=stop_timeout,
        )
        # The settings deploy/gunicorn.conf.py reads; SIGTERM waits less than stop() does.
        self.environ.update(
            {
                "BIND": f"{LOOPBACK}:{self.port}",
                "WEB_CONCURRENCY": str(workers),
                "PETSTORE_THREADS": str(threads),
                "GUNICORN_GRACEFUL_TIMEOUT": str(max(1, int(stop_timeout) - 2)),
            }
        )
        self.address = f"{LOOPBACK}:{self.port}"
        self.app = list(app)
        self.tree = tree

    def command(self) -> list[str]:
        """The shipped config file and the app, nothing else."""
        config_file = self.tree / GUNICORN_CONF.relative_to(ROOT)
        return [sys.executable, "-m", "gunicorn", "-c", str(config_file), *self.app]

    def records(self) -> list[dict[str, Any]]:
        """The log as JSON objects (lines that are not JSON are left out; see log_lines)."""
        return [record for record in parse_lines(self.log_lines()) if record is not None]

    def logged(
        self, request_ids: Collection[str], within: float = 5.0
    ) -> dict[str, dict[str, Any]]:
        """request id -> the app's access record of these requests, waiting (bounded) for the last.

        The app writes its access lines in batches, at most petstore.logs.FLUSH_SECONDS after
        the answer, so a client may read the log before its line is there.
        """
        wanted = set(request_ids)
        return poll_until(
            lambda: {
                record["request_id"]: record
                for record in self.records()
                if record.get("logger") == "petstore.access" and record["request_id"] in wanted
            },
            lambda found: len(found) == len(wanted),
            within,
        )

    def log_lines(self) -> list[str]:
        """Every line of the log."""
        return self.log_path.read_text(encoding="utf-8", errors="replace").splitlines()


@dataclass
class Deployment:
    """gunicorn instances (the shipped config) behind one nginx (the shipped site), all on loopback."""

    instances: list[DeployedGunicorn]
    nginx: Nginx

    @property
    def url(self) -> str:
        """Where clients send requests: nginx."""
        return self.nginx.url

    def served_by(self, request_ids: Collection[str]) -> dict[str, str]:
        """request id -> the upstream address nginx sent it to last, from nginx's access log."""
        logged = self.nginx.logged(request_ids)
        return {
            request_id: entry["upstream"].split(", ")[-1] for request_id, entry in logged.items()
        }


@contextmanager
def deploy(
    environ: Mapping[str, str],
    workdir: Path,
    *,
    instances: int = 2,
    workers: int = 2,
    threads: int = 2,
    nginx_workers: int = 2,
) -> Iterator[Deployment]:
    """Start `instances` gunicorns with `environ`, nginx in front of them; stop everything on exit."""
    with ExitStack() as stack:
        servers = [
            stack.enter_context(
                DeployedGunicorn(
                    environ, workdir / f"gunicorn-{n}.log", workers=workers, threads=threads
                )
            )
            for n in range(instances)
        ]
        proxy = stack.enter_context(
            Nginx([server.address for server in servers], workdir / "nginx", workers=nginx_workers)
        )
        yield Deployment(servers, proxy)


def parse_lines(lines: Sequence[str]) -> list[dict[str, Any] | None]:
    """Each line as a JSON object, or None where it is not one."""
    parsed: list[dict[str, Any] | None] = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            record = None
        parsed.append(record if isinstance(record, dict) else None)
    return parsed

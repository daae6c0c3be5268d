"""The service's image (`make image`, deploy/image/build.sh) under podman, built once per commit.

With PostgreSQL and Redis on loopback (the host's network): the image migrates a fresh database
and creates a key, serves as uid 10001 on a read-only root filesystem, stops on SIGTERM under
load with every accepted request answered and status 0, and refuses a missing DATABASE_URL in
one line with status 2. Runs as root (debootstrap and podman's storage).
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support import reports
from tests.support.checks import call
from tests.support.databases import empty_database
from tests.support.podman import (
    IMAGE,
    RUN_FLAGS,
    UID,
    Container,
    commit_image,
    git_commit,
    podman,
    run_once,
)
from tests.support.servers import LOOPBACK, ROOT, poll_until

MAX_SIZE = 200 * 1000 * 1000
REQUIREMENTS = ROOT / "deploy" / "requirements.txt"
# The container's gunicorn: sync workers (redis://), one for each client of the SIGTERM test and
# a spare; running requests are given 20 s on SIGTERM (the default).
SERVE = {"WEB_CONCURRENCY": "5", "GUNICORN_GRACEFUL_TIMEOUT": "20"}


@pytest.fixture(scope="module")
def image() -> str:
    """The image of this commit: built by `make image` once, reused while its tag exists."""
    if os.geteuid() != 0:
        pytest.skip(
            "builds and runs the image as root (debootstrap, podman): run `make test` as root"
        )
    return commit_image()


@dataclass
class Deployment:
    """A database the image migrated, and a key the image created in it."""

    database_url: str
    key: str
    outputs: list[str] = field(default_factory=list)


@pytest.fixture(scope="module")
def deployment(image: str, database_url: str) -> Iterator[Deployment]:
    """A fresh database that the image migrated (`petstore db upgrade`), with a key it created."""
    with empty_database(database_url, "_image") as url:
        environ = {"DATABASE_URL": url}
        upgraded = run_once(image, "petstore", "db", "upgrade", environ=environ)
        assert upgraded.returncode == 0, upgraded.stderr
        created = run_once(
            image,
            "petstore",
            "keys",
            "create",
            "--plan",
            "enterprise",
            "--per-minute",
            "100000",
            "--per-day",
            "1000000",
            "--label",
            "image",
            environ=environ,
        )
        assert created.returncode == 0, created.stderr
        key = created.stdout.splitlines()[-1]
        yield Deployment(url, key, [upgraded.stdout, created.stdout])


def serving(image: str, deployment: Deployment, redis_url: str) -> Container:
    """The image's gunicorn, read-only, on a free loopback port, counting in Redis."""
    environ = {
        "DATABASE_URL": deployment.database_url,
        "RATELIMIT_STORAGE_URI": redis_url,
        **SERVE,
    }
    return Container(image, environ, flags=["--read-only"])


def normal(pin: str) -> str:
    """A pin `name==version` with its name normalized as PyPI does (lower case, runs of -_. as -)."""
    name, _, version = pin.partition("==")
    return f"{re.sub(r'[-_.]+', '-', name).lower()}=={version}"


def test_the_image_is_small_and_holds_no_build_tools(image: str) -> None:
    size = int(podman("image", "inspect", "--format", "{{.Size}}", image).stdout)
    config = json.loads(podman("image", "inspect", "--format", "{{json .Config}}", image).stdout)
    labels = json.loads(podman("image", "inspect", "--format", "{{json .Labels}}", image).stdout)
    reports.add("the image", [f"{image}: {size:,} bytes uncompressed (at most {MAX_SIZE:,})"])

    assert size <= MAX_SIZE
    assert config["User"] == f"{UID}:{UID}"
    assert config["WorkingDir"] == "/opt/petstore"
    assert config["Cmd"] == ["gunicorn", "--config", "/opt/petstore/gunicorn.conf.py", "wsgi:app"]
    assert not config.get("Entrypoint")
    assert config["StopSignal"] == "SIGTERM"
    assert list(config["ExposedPorts"]) == ["8000/tcp"]
    assert {"BIND=0.0.0.0:8000", "PYTHONUNBUFFERED=1", "PYTHONDONTWRITEBYTECODE=1"} <= set(
        config["Env"]
    )
    assert any(v.startswith("PATH=/opt/petstore/venv/bin:") for v in config["Env"])
    assert labels["org.opencontainers.image.revision"] == git_commit()

    # As root in the image, to see every directory: no compiler, no pip, no caches, no apt lists.
    looked = run_once(
        image,
        "sh",
        "-c",
        "for c in cc gcc c++ g++ clang tcc; do command -v $c; done;"
        " ls -A /var/lib/apt/lists /var/cache/apt/archives /root/.cache /opt/petstore/.cache"
        " /usr/share/man /usr/share/locale 2>/dev/null;"
        " /opt/petstore/venv/bin/python -m pip --version 2>/dev/null;"
        " dpkg-query -W -f '${Package}\\n' | grep -E '^(gcc|cpp|g\\+\\+|clang|binutils|libc6-dev)(-[0-9]+)?$';"
        " echo done",
        flags=["--user", "0"],
    )
    assert looked.returncode == 0, looked.stderr
    lines = looked.stdout.split()
    # What ls may print: the directories' names and their empty lock files.
    assert [
        line for line in lines if not line.endswith(":") and line not in ("lock", "partial")
    ] == ["done"]


def test_the_image_holds_the_pinned_packages_and_records_debians(image: str) -> None:
    """The venv holds exactly deploy/requirements.txt and petstore; the Debian versions are listed."""
    listed = run_once(
        image,
        "python",
        "-c",
        "import importlib.metadata as m; "
        "print('\\n'.join(sorted(f'{d.name.lower()}=={d.version}' for d in m.distributions())))",
    )
    recorded = run_once(image, "cat", "/opt/petstore/debian-packages.txt")
    queried = run_once(image, "dpkg-query", "-W", "-f", "${Package} ${Version}\\n")

    pins = {
        normal(re.split(r"\s*;", line)[0])
        for line in REQUIREMENTS.read_text().splitlines()
        if line and not line.startswith("#")
    }
    version = re.search(r"^version = (\S+)$", (ROOT / "setup.cfg").read_text(), re.M)
    assert version is not None
    installed = {normal(line) for line in listed.stdout.split()}
    assert installed == pins | {f"petstore=={version.group(1)}"}
    assert recorded.stdout == queried.stdout
    assert "python3.11 " in recorded.stdout


def test_the_pins_agree_with_setup_cfg() -> None:
    """Every pin of install_requires is in deploy/requirements.txt at the same version."""
    text = (ROOT / "setup.cfg").read_text()
    block = text[text.index("install_requires =") : text.index("[options.packages.find]")]
    wanted = {
        normal(re.sub(r"\[.*\]", "", line.strip()))
        for line in block.splitlines()[1:]
        if "==" in line and not line.strip().startswith("#")
    }
    pins = {normal(line.split(" ;")[0]) for line in REQUIREMENTS.read_text().splitlines()}
    assert wanted
    assert wanted - pins == set()


def test_the_docs_give_the_flags_the_tests_use() -> None:
    """README.rst's and docs/deploying.rst's `flags=...` line is what these tests pass to podman."""
    line = f'flags="{" ".join(RUN_FLAGS)}"'
    for page in (ROOT / "README.rst", ROOT / "docs" / "deploying.rst"):
        assert f"    {line}\n" in page.read_text(encoding="utf-8"), page


def readme_container_commands() -> list[str]:
    """The lines of README.rst's "Container" code block, as a reader would paste them."""
    text = (ROOT / "README.rst").read_text(encoding="utf-8")
    section = text.split("\nContainer\n---------\n", 1)[1].split("\n.. code-block:: bash\n", 1)[1]
    block = section.split("\n\n", 1)[0]
    return [line.strip() for line in block.splitlines() if line.strip()]


def test_the_readme_container_commands_run_as_written(image: str, database_url: str) -> None:
    """README.rst's commands, pasted into bash with DATABASE_URL exported: `make image` (done by
    the fixture, which runs it), the migration, then the service on 127.0.0.1:8000 until SIGTERM
    (podman passes it on to the container, which drains and exits)."""
    make, flags, upgrade, serve = readme_container_commands()
    assert make.startswith("make image") and flags.startswith("flags=")
    # The README runs the image as `localhost/petstore`, the :latest that `make image` tags.
    tagged = podman("tag", image, f"{IMAGE}:latest")
    assert tagged.returncode == 0, tagged.stderr
    with socket.socket() as probe:
        assert probe.connect_ex((LOOPBACK, 8000)) != 0, "the README's port 8000 is taken"
    with empty_database(database_url, "_readme_image") as url:
        environ = {**os.environ, "DATABASE_URL": url}
        migrated = subprocess.run(
            ["bash", "-euc", f"{flags}\n{upgrade}"],
            env=environ,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert migrated.returncode == 0, migrated.stderr
        assert migrated.stdout.startswith("applied: 0001_pets_and_keys.sql, "), migrated.stdout
        server = subprocess.Popen(
            ["bash", "-euc", f"{flags}\nexec {serve}"],
            env=environ,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

        def healthz() -> int | None:
            """/healthz's status, 0 while nothing listens, None once the command has ended."""
            if server.poll() is not None:
                return None
            try:
                return call(f"http://{LOOPBACK}:8000", "GET", "/healthz", timeout=5).status
            except OSError:
                return 0

        try:
            status = poll_until(healthz, lambda status: status != 0, within=60, interval=0.25)
            assert status == 200, status
            server.terminate()
            output, _ = server.communicate(timeout=60)
            assert server.returncode == 0, output
        finally:
            if server.poll() is None:
                server.kill()
                server.communicate(timeout=30)
            for leftover in podman(
                "ps", "--all", "--quiet", "--filter", f"ancestor={IMAGE}:latest"
            ).stdout.split():
                podman("rm", "--force", "--time", "0", leftover)


def test_the_image_migrated_and_made_a_key(deployment: Deployment) -> None:
    upgraded, created = deployment.outputs
    assert upgraded.startswith("applied: 0001_pets_and_keys.sql, ")
    assert "created key 1 (" in created
    assert re.fullmatch(r"ps_[A-Za-z0-9_-]{43}", deployment.key)


def test_the_image_serves_read_only_as_its_own_user(
    image: str, deployment: Deployment, redis_url: str
) -> None:
    auth = {"Authorization": f"Bearer {deployment.key}"}
    with serving(image, deployment, redis_url) as container:
        health = call(container.url, "GET", "/healthz")
        ready = call(container.url, "GET", "/readyz")
        created = call(
            container.url,
            "POST",
            "/v1/pets",
            headers=auth,
            json_body={"name": "Crate", "categoryId": 1, "status": "available"},
        )
        fetched = call(container.url, "GET", f"/v1/pets/{created.body['id']}", headers=auth)
        listed = call(container.url, "GET", "/v1/pets", headers=auth)
        metrics = call(container.url, "GET", "/metrics")
        master = int(container.inspect("{{.State.Pid}}"))
        status = Path(f"/proc/{master}/status").read_text()
        inside = container.exec("id", "-u")
        written = container.exec("touch", "/opt/petstore/written")
        # Where it writes: the metrics directory and gunicorn's worker files, in /tmp (a tmpfs).
        tmp = container.exec("sh", "-c", "ls -A /tmp; ls /tmp/petstore-metrics-*")

    assert health.status == 200
    assert ready.status == 200, ready.body
    assert created.status == 201, created.body
    assert fetched.status == 200 and fetched.body["name"] == "Crate"
    assert listed.status == 200 and "Crate" in [pet["name"] for pet in listed.body]
    assert metrics.status == 200 and b"petstore_" in metrics.raw
    assert re.search(rf"^Uid:\s+{UID}\s+{UID}\s+{UID}\s+{UID}$", status, re.M), status
    assert inside.stdout.strip() == str(UID)
    assert written.returncode != 0 and "Read-only file system" in written.stderr
    assert tmp.returncode == 0 and "petstore-metrics-" in tmp.stdout, tmp.stdout + tmp.stderr
    assert container.exit_code == 0, container.logs


def test_sigterm_under_load_answers_every_accepted_request_and_exits_0(
    image: str, deployment: Deployment, redis_url: str
) -> None:
    """`podman stop` (SIGTERM) while two clients send requests and two slow POSTs are half sent.

    The clients stop starting requests at `podman stop`, as a load balancer stops sending first
    (docs/deploying.rst, "In a container"); everything they sent is answered, nothing is reset.
    gunicorn stops listening at once, while the slow POSTs are still read: a new connection is
    refused. The slow POSTs' bodies arrive 2 s after `podman stop`: answered 201. Status 0.
    """
    auth = {"Authorization": f"Bearer {deployment.key}"}
    container = serving(image, deployment, redis_url)
    tally = Tally()
    with container:
        clients = [threading.Thread(target=tally.client, args=(container.url, auth)) for _ in "ab"]
        slow = [threading.Thread(target=tally.slow_post, args=(container.port, auth)) for _ in "ab"]
        for thread in [*clients, *slow]:
            thread.start()
        poll_until(lambda: tally.answered, lambda answered: answered >= 50, within=30.0)
        assert poll_until(lambda: tally.slow_sent, lambda sent: sent == 2, within=10.0) == 2
        tally.stopped_at = time.monotonic()
        tally.stopped.set()
        stopping = container.signal_stop()
        refused_after = tally.probe(container.port, within=SLOW_BODY_AFTER)
        stopping.communicate(timeout=container.stop_timeout + 30)
        took = time.monotonic() - tally.stopped_at
        for thread in [*clients, *slow]:
            thread.join(timeout=30)

    reports.add(
        "the image under SIGTERM (podman stop)",
        [
            f"requests answered: {tally.answered}; sent before `podman stop` and answered after "
            f"it: {tally.in_flight} (the two slow POSTs among them: {tally.slow_statuses}); "
            f"reset, cut short or timed out: {len(tally.resets)}; not 2xx: {len(tally.bad)}",
            f"a new connection refused {refused_after} s after `podman stop`; the container "
            f"exited with status {container.exit_code}, {took:.1f} s after `podman stop`",
        ],
    )
    assert tally.resets == []
    assert tally.bad == []
    assert tally.slow_statuses == [201, 201]
    assert tally.in_flight >= 2
    assert refused_after is not None, "gunicorn still listened while it read the slow requests"
    assert container.exit_code == 0, container.logs
    assert SLOW_BODY_AFTER < took < int(SERVE["GUNICORN_GRACEFUL_TIMEOUT"]), container.logs
    assert "Exception in worker process" not in container.logs


# When the slow POSTs of the SIGTERM test send the rest of their bodies, after `podman stop`.
SLOW_BODY_AFTER = 2.0


@dataclass
class Tally:
    """What the clients of the SIGTERM test got, counted."""

    answered: int = 0
    in_flight: int = 0
    resets: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    slow_sent: int = 0
    slow_statuses: list[int] = field(default_factory=list)
    stopped_at: float | None = None
    stopped: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def counted(self, sent: float, status: int, what: str) -> None:
        with self.lock:
            self.answered += 1
            if self.stopped_at is not None and sent < self.stopped_at:
                self.in_flight += 1
            if not 200 <= status < 300:
                self.bad.append(f"{what}: {status}")

    def failed(self, what: str, sent: float, exc: OSError) -> None:
        after = "" if self.stopped_at is None else f", {sent - self.stopped_at:+.3f} s"
        with self.lock:
            self.resets.append(f"{what} (sent{after} from podman stop): {exc!r}")

    def client(self, url: str, auth: dict[str, str]) -> None:
        """Lists and creates, one at a time on a new connection each, until `podman stop`."""
        number = 0
        while not self.stopped.is_set():
            number += 1
            sent = time.monotonic()
            try:
                if number % 2:
                    answer = call(url, "GET", "/v1/pets?limit=5", headers=auth, timeout=30)
                else:
                    body = {"name": f"load-{number}", "categoryId": 2}
                    answer = call(url, "POST", "/v1/pets", headers=auth, json_body=body, timeout=30)
            except OSError as exc:
                self.failed("a request", sent, exc)
                continue
            self.counted(sent, answer.status, f"{answer.method} {answer.path}")

    def slow_post(self, port: int, auth: dict[str, str]) -> None:
        """A create whose body arrives in two parts, the second SLOW_BODY_AFTER s after `podman stop`."""
        body = json.dumps({"name": "slow", "categoryId": 2}).encode()
        head = (
            f"POST /v1/pets HTTP/1.1\r\nHost: {LOOPBACK}:{port}\r\n"
            f"Authorization: {auth['Authorization']}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
        ).encode()
        sent = time.monotonic()
        reply = b""
        try:
            with socket.create_connection((LOOPBACK, port), timeout=60) as sock:
                sock.sendall(head + body[:10])
                with self.lock:
                    self.slow_sent += 1
                self.stopped.wait(timeout=60)
                time.sleep(SLOW_BODY_AFTER)
                sock.sendall(body[10:])
                while chunk := sock.recv(65536):
                    reply += chunk
        except OSError as exc:
            self.failed("a slow POST", sent, exc)
            return
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else 0
        with self.lock:
            self.slow_statuses.append(status)
        self.counted(sent, status, "a slow POST")

    def probe(self, port: int, within: float) -> float | None:
        """Seconds from `podman stop` to a connection refused (none within `within`: None).

        Until then a connection is made and closed unused: it carries no request to lose.
        """
        assert self.stopped_at is not None
        while (waited := time.monotonic() - self.stopped_at) < within:
            try:
                socket.create_connection((LOOPBACK, port), timeout=5).close()
            except ConnectionRefusedError:
                return round(waited, 2)
            time.sleep(0.05)
        return None


def test_no_database_url_is_one_line_and_status_2(image: str) -> None:
    done = run_once(image)

    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.splitlines() == [
        "petstore: DATABASE_URL is not set: expected the libpq URL of the PostgreSQL database, "
        "such as postgresql://user:password@host:5432/dbname "
        "(or use `make run`, which starts an embedded one)"
    ]

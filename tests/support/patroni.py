"""etcd and Patroni-managed PostgreSQL 15 nodes on loopback, from the shipped deploy/patroni.yml."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import signal
import subprocess
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml
from psycopg import conninfo

from petstore import config, db, keys, migrations
from petstore.dev.server import ensure_database
from tests.support.programs import program
from tests.support.redis_servers import RedisServer
from tests.support.servers import (
    LOOPBACK,
    ROOT,
    ServerProcess,
    Service,
    free_port,
    poll_until,
    run_every,
)

PATRONI_YML = ROOT / "deploy" / "patroni.yml"
PG_BIN = Path("/usr/lib/postgresql/15/bin")
# The longest a node may take to become the primary, or the synchronous standby.
CLUSTER_READY = 90.0


def account() -> pwd.struct_passwd | None:
    """Whom PostgreSQL runs as: ourselves, or petstore.dev.embedded's system account when we are root."""
    if os.geteuid() != 0:
        return None
    from petstore.dev import embedded

    found: pwd.struct_passwd | None = embedded._service_account()
    return found


def as_account(command: list[str]) -> list[str]:
    """`command`, run as account() (setpriv execs it: the pid stays the program's)."""
    user = account()
    if user is None:
        return command
    ids = [f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups"]
    return ["setpriv", *ids, *command]


def give_to_account(path: Path) -> None:
    """Make `path` (a new directory) the account's, and reachable by it."""
    path.mkdir(parents=True, exist_ok=True)
    user = account()
    if user is None:
        return
    shutil.chown(path, user.pw_uid, user.pw_gid)
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & 0o001:
            parent.chmod(mode | 0o001)  # traverse only, as petstore.dev.embedded does


def get_json(url: str, timeout: float = 1.0) -> tuple[int, Any]:
    """(status, JSON body) of a GET; (0, None) when nothing answers."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status, json.loads(response.read() or b"null")
    except urllib.error.HTTPError as error:
        body = error.read()
        try:
            return error.code, json.loads(body or b"null")
        except ValueError:
            return error.code, None
    except (OSError, ValueError):
        return 0, None


class Etcd(ServerProcess):
    """A one-member etcd 3.4 on free loopback ports (clients also on `also_listen`), its data in `workdir`."""

    name = "etcd"
    ready = "report healthy"

    def __init__(self, workdir: Path, also_listen: Sequence[str] = ()) -> None:
        super().__init__(workdir / "etcd.log", start_timeout=20.0, stop_timeout=10.0)
        self.workdir = workdir
        self.peer_port = free_port()
        self.also_listen = list(also_listen)

    @property
    def endpoint(self) -> str:
        return f"{LOOPBACK}:{self.port}"

    def start(self) -> None:
        peer = f"http://{LOOPBACK}:{self.peer_port}"
        client = f"http://{self.endpoint}"
        command = [
            program("etcd"),
            "--name=petstore-test",
            f"--data-dir={self.workdir / 'etcd-data'}",
            "--listen-client-urls="
            + ",".join([client, *(f"http://{host}:{self.port}" for host in self.also_listen)]),
            f"--advertise-client-urls={client}",
            f"--listen-peer-urls={peer}",
            f"--initial-advertise-peer-urls={peer}",
            f"--initial-cluster=petstore-test={peer}",
        ]
        self.launch(command, cwd=self.workdir)

    def answers(self) -> bool:
        status, body = get_json(f"http://{self.endpoint}/health")
        return status == 200 and isinstance(body, dict) and body.get("health") == "true"


class PatroniNode(ServerProcess):
    """`patroni` with deploy/patroni.yml for one node: its PostgreSQL port is `port`.

    On loopback, or at `host` in namespace `netns` (reaching etcd at `etcd_host`), trusting
    every client on the test's links there.
    """

    name = "patroni"
    ready = "answer on its REST API"

    def __init__(
        self,
        workdir: Path,
        name: str,
        etcd: Etcd,
        *,
        netns: str | None = None,
        host: str = LOOPBACK,
        etcd_host: str = LOOPBACK,
    ) -> None:
        super().__init__(workdir / f"{name}.log", start_timeout=60.0, stop_timeout=20.0)
        self.netns = netns
        self.host = host
        self.etcd_host = etcd_host
        self.log_mode = "ab"
        self.workdir = workdir
        self.node = name
        self.etcd = etcd
        self.rest_port = free_port()
        self.home = workdir / name
        self.config_path = self.home / "patroni.yml"

    @property
    def address(self) -> tuple[str, int]:
        return self.host, self.port

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    def config(self) -> dict[str, Any]:
        """The shipped file with this node's name, addresses, paths and trust on loopback."""
        settings: dict[str, Any] = yaml.safe_load(PATRONI_YML.read_text(encoding="utf-8"))
        settings["name"] = self.node
        settings["restapi"] = {
            "listen": f"{self.host}:{self.rest_port}",
            "connect_address": f"{self.host}:{self.rest_port}",
        }
        # etcd advertises its loopback address: in a namespace, the one given here, as a proxy.
        etcd_hosts = f"{self.etcd_host}:{self.etcd.port}"
        settings["etcd3"] = {"hosts": etcd_hosts, "use_proxies": self.netns is not None}
        # Never a watchdog here: one that fired would reset the machine running the tests.
        settings["watchdog"] = {"mode": "off"}
        postgresql = settings["postgresql"]
        postgresql["listen"] = f"{self.host}:{self.port}"
        postgresql["connect_address"] = f"{self.host}:{self.port}"
        postgresql["data_dir"] = str(self.data_dir)
        postgresql["bin_dir"] = str(PG_BIN)
        postgresql["pgpass"] = str(self.home / "pgpass")
        postgresql["parameters"]["unix_socket_directories"] = str(self.home)
        postgresql["pg_hba"] = [
            "local all all trust",
            f"host replication replicator {LOOPBACK}/32 trust",
            f"host all all {LOOPBACK}/32 trust",
            *(
                ["host replication replicator 10.0.0.0/8 trust", "host all all 10.0.0.0/8 trust"]
                if self.netns is not None
                else []
            ),
        ]
        return settings

    def start(self) -> None:
        assert self.process is None, f"{self.node} is running already"
        give_to_account(self.home)
        self.config_path.write_text(yaml.safe_dump(self.config()), encoding="utf-8")
        self.config_path.chmod(0o644)
        environ = {key: value for key, value in os.environ.items() if not key.startswith("PG")}
        environ["HOME"] = str(self.home)
        self.launch(
            as_account([program("patroni"), str(self.config_path)]), cwd=self.home, env=environ
        )

    def answers(self) -> bool:
        status, _body = get_json(f"http://{self.host}:{self.rest_port}/patroni")
        return status in (200, 503)

    def state(self) -> dict[str, Any]:
        """Patroni's view of this node (role, state, timeline...), or {} when it does not answer."""
        status, body = get_json(f"http://{self.host}:{self.rest_port}/patroni")
        return body if status in (200, 503) and isinstance(body, dict) else {}

    def is_primary(self) -> bool:
        status, _body = get_json(f"http://{self.host}:{self.rest_port}/primary")
        return status == 200

    def is_sync_standby(self) -> bool:
        status, _body = get_json(f"http://{self.host}:{self.rest_port}/sync")
        return status == 200

    def postmaster_pid(self) -> int | None:
        """The pid in the data directory's postmaster.pid, or None."""
        try:
            return int((self.data_dir / "postmaster.pid").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def kill(self) -> None:
        """kill -9 of Patroni and of its postmaster: the node dies as a crashed machine would."""
        postmaster = self.postmaster_pid()
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        if postmaster is not None:
            try:
                os.kill(postmaster, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.process.wait(timeout=10)
        self.process = None

    def kill_patroni(self) -> None:
        """kill -9 of Patroni alone (an OOM kill, a crash of its Python): its postmaster runs on."""
        assert self.process is not None
        self.process.kill()
        self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        """Stop Patroni (it stops its PostgreSQL first); then make sure the postmaster is gone."""
        postmaster = self.postmaster_pid()
        super().stop()
        if postmaster is not None:
            try:
                os.kill(postmaster, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def patronictl(self, *args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
        """`patronictl -c <this node's file> args...`."""
        return subprocess.run(
            [program("patronictl"), "-c", str(self.config_path), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env={**os.environ, "HOME": str(self.home)},
        )


class Cluster(Service):
    """etcd, Patroni nodes db1 and db2 (db1 the first primary, db2 its synchronous standby), Redis,
    a database `petstore` migrated and a key issued; a Service (a with block starts and stops it)."""

    def __init__(
        self,
        workdir: Path,
        connect_timeout: int,
        place: Callable[[Etcd, str], PatroniNode] | None = None,
        etcd: Etcd | None = None,
    ) -> None:
        """`place(etcd, name)` makes each node (default: on loopback)."""
        self.workdir = workdir
        self.connect_timeout = connect_timeout
        self.etcd = etcd or Etcd(workdir)
        make = place or (lambda etcd, name: PatroniNode(workdir, name, etcd))
        self.nodes = [make(self.etcd, name) for name in ("db1", "db2")]
        self.redis = RedisServer(workdir / "redis")
        self.key = ""

    def start(self) -> None:
        """Redis, etcd, then db1 until it leads and db2 until it is its synchronous standby."""
        self.redis.start()
        self.etcd.start()
        first, second = self.nodes
        first.start()
        assert poll_until(first.is_primary, bool, CLUSTER_READY, 0.2), first.log()
        second.start()
        assert poll_until(second.is_sync_standby, bool, CLUSTER_READY, 0.2), second.log()
        ensure_database(self.url("postgres"), "petstore")
        with self.connect() as conn:
            migrations.upgrade(conn)
            self.key, _row = keys.issue_key(conn, "enterprise", "patroni", 10**7, 10**8)

    def stop(self) -> None:
        """Every node, etcd and Redis, each stopped even when another fails to."""
        run_every([*(node.stop for node in self.nodes), self.etcd.stop, self.redis.stop])

    def url(self, dbname: str = "petstore", attrs: str = "read-write") -> str:
        """docs/deploying.rst's multi-host URL: every node, the one with `attrs` chosen by libpq."""
        return conninfo.make_conninfo(
            "",
            host=",".join(node.address[0] for node in self.nodes),
            port=",".join(str(node.address[1]) for node in self.nodes),
            dbname=dbname,
            user="postgres",
            target_session_attrs=attrs,
            connect_timeout=str(self.connect_timeout),
        )

    def connect_to(self, node: PatroniNode) -> db.Connection:
        """A connection to this node's database, whatever its role."""
        host, port = node.address
        url = conninfo.make_conninfo(
            "", host=host, port=str(port), dbname="petstore", user="postgres"
        )
        return db.connect(config.from_environ({"DATABASE_URL": url}))

    def connect(self) -> db.Connection:
        """A connection to the primary, whichever node it is."""
        return db.connect(config.from_environ({"DATABASE_URL": self.url()}))

    def primary(self) -> PatroniNode:
        leaders = [node for node in self.nodes if node.process is not None and node.is_primary()]
        assert len(leaders) == 1, [node.state() for node in self.nodes]
        return leaders[0]

    def standby(self) -> PatroniNode:
        return next(node for node in self.nodes if node is not self.primary())

    def whole(self) -> bool:
        """Whether one node leads and every other is its synchronous standby."""
        leaders = [node for node in self.nodes if node.process is not None and node.is_primary()]
        others = [node for node in self.nodes if node not in leaders]
        return len(leaders) == 1 and all(node.is_sync_standby() for node in others)

    def heal(self) -> None:
        """Every node's Patroni running again, until one leads and the other is its synchronous
        standby: a test on a shared cluster starts whole even when the one before it failed
        halfway, with a node still down."""
        for node in self.nodes:
            if node.process is None:
                node.start()
        assert poll_until(self.whole, bool, CLUSTER_READY, 0.2), [n.state() for n in self.nodes]

    def wait_for_sync_standby(self, node: PatroniNode) -> None:
        assert poll_until(node.is_sync_standby, bool, CLUSTER_READY, 0.2), node.log()

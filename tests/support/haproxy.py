"""HAProxy with the shipped deploy/haproxy.cfg on a free loopback port, before a Patroni cluster's nodes."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from psycopg import conninfo

from tests.support.patroni import PatroniNode
from tests.support.programs import program
from tests.support.servers import LOOPBACK, ROOT, ServerProcess, accepts_connections

HAPROXY_CFG = ROOT / "deploy" / "haproxy.cfg"


class HAProxy(ServerProcess):
    """`haproxy` in the foreground with deploy/haproxy.cfg: its `listen primary` on `port`, its
    servers the `nodes`, each checked on its Patroni REST port.

    A node's server is its PostgreSQL, or `targets[node name]` (host, port): a PgBouncer before
    it, say. Only the addresses differ from the shipped file.
    """

    name = "haproxy"
    ready = "accept connections"

    def __init__(
        self,
        workdir: Path,
        nodes: Sequence[PatroniNode],
        targets: Mapping[str, tuple[str, int]] | None = None,
    ) -> None:
        super().__init__(workdir / "haproxy.log", start_timeout=10.0, stop_timeout=10.0)
        self.workdir = workdir
        self.nodes = list(nodes)
        self.targets = dict(targets or {})

    def url(self, dbname: str = "petstore", connect_timeout: int = 2) -> str:
        """The libpq URL of the primary's database, through this HAProxy."""
        return conninfo.make_conninfo(
            "",
            host=LOOPBACK,
            port=str(self.port),
            dbname=dbname,
            user="postgres",
            connect_timeout=str(connect_timeout),
        )

    def write_config(self) -> Path:
        """deploy/haproxy.cfg with this test's bind address and the nodes' addresses."""
        text = HAPROXY_CFG.read_text(encoding="utf-8")
        assert text.count("    bind *:5000\n") == 1, (
            "deploy/haproxy.cfg changed: update the harness"
        )
        text = text.replace("    bind *:5000\n", f"    bind {LOOPBACK}:{self.port}\n")
        shipped = re.findall(r"^    server (\S+) \S+ (.*) check port 8008$", text, re.MULTILINE)
        assert len(shipped) == len(self.nodes), shipped
        for (name, options), node in zip(shipped, self.nodes, strict=True):
            host, port = self.targets.get(node.node, node.address)
            text = text.replace(
                f"    server {name} {name}:5432 {options} check port 8008\n",
                f"    server {node.node} {host}:{port} {options} check addr {node.host} "
                f"port {node.rest_port}\n",
            )
        path = self.workdir / "haproxy.cfg"
        path.write_text(text, encoding="utf-8")
        return path

    def start(self) -> None:
        """Start haproxy (-db: in the foreground) and wait (bounded) until it accepts connections."""
        assert self.process is None, "haproxy is running already"
        self.workdir.mkdir(parents=True, exist_ok=True)
        config = self.write_config()
        self.launch([program("haproxy"), "-db", "-f", str(config)], cwd=self.workdir)

    def answers(self) -> bool:
        """Whether it accepts TCP connections right now."""
        return accepts_connections(self.port)

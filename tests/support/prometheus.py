"""A real Prometheus for tests: Debian's `prometheus` with the shipped scrape config, and its query API."""

from __future__ import annotations

import http.client
import json
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.support.programs import program
from tests.support.servers import LOOPBACK, ServerProcess, poll_until

ROOT = Path(__file__).resolve().parents[2]
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus.yml"
ALERTS = ROOT / "deploy" / "alerts.yml"


def binary(name: str) -> str:
    """`prometheus` or `promtool`; skips the test when missing (conftest fails skips under CI)."""
    return program(name)


def render_config(targets: Sequence[str], interval: str) -> dict[str, Any]:
    """deploy/prometheus.yml with these targets, this scrape and evaluation interval, the rules by path."""
    config: dict[str, Any] = yaml.safe_load(SCRAPE_CONFIG.read_text(encoding="utf-8"))
    config["global"].update(
        {"scrape_interval": interval, "scrape_timeout": interval, "evaluation_interval": interval}
    )
    config["rule_files"] = [str(SCRAPE_CONFIG.parent / name) for name in config["rule_files"]]
    (job,) = config["scrape_configs"]
    job["static_configs"] = [{"targets": list(targets)}]
    return config


class Prometheus(ServerProcess):
    """`prometheus` scraping `targets` every `interval`, its data in `workdir`, as a context manager."""

    name = "prometheus"
    ready = "answer /-/ready"
    poll_interval = 0.1

    def __init__(
        self,
        targets: Sequence[str],
        workdir: Path,
        *,
        interval: str = "1s",
        start_timeout: float = 30.0,
        stop_timeout: float = 10.0,
    ) -> None:
        super().__init__(
            workdir / "prometheus.log", start_timeout=start_timeout, stop_timeout=stop_timeout
        )
        self.targets = list(targets)
        self.workdir = workdir
        self.interval = interval

    def start(self) -> None:
        """Write the config, start prometheus and wait (bounded) until it is ready."""
        self.workdir.mkdir(parents=True, exist_ok=True)
        config_path = self.workdir / "prometheus.yml"
        config_path.write_text(
            yaml.safe_dump(render_config(self.targets, self.interval)), encoding="utf-8"
        )
        self.launch(
            [
                binary("prometheus"),
                f"--config.file={config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address={LOOPBACK}:{self.port}",
                "--log.level=warn",
            ],
            cwd=self.workdir,
        )

    def get(self, path: str) -> tuple[int, Any]:
        """(status, JSON body) of a GET to Prometheus' HTTP API."""
        connection = http.client.HTTPConnection(LOOPBACK, self.port, timeout=5)
        try:
            connection.request("GET", path)
            response = connection.getresponse()
            raw = response.read()
        finally:
            connection.close()
        try:
            return response.status, json.loads(raw)
        except ValueError:
            return response.status, raw.decode(errors="replace")

    def answers(self) -> bool:
        """Whether /-/ready answers 200 right now."""
        try:
            return self.get("/-/ready")[0] == 200
        except OSError:
            return False

    def query(self, promql: str) -> list[dict[str, Any]]:
        """The instant vector of a PromQL query (its `result`); fails the test on an API error."""
        status, body = self.get("/api/v1/query?" + urllib.parse.urlencode({"query": promql}))
        assert status == 200 and body["status"] == "success", (promql, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def value(self, promql: str) -> float | None:
        """The one value of a query that answers one series, or None when it answers none."""
        result = self.query(promql)
        if not result:
            return None
        assert len(result) == 1, (promql, result)
        return float(result[0]["value"][1])

    def wait_value(self, promql: str, expected: float, within: float = 20.0) -> float | None:
        """Poll (bounded) until the query answers `expected`; the last value, for the assertion."""
        return poll_until(lambda: self.value(promql), lambda got: got == expected, within, 0.25)

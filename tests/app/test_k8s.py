"""deploy/k8s/: kustomize renders the base and the example overlay, kubernetes-validate accepts
them, and they agree with the service, its image and the guide (docs/deploying.rst, "On
Kubernetes"). No cluster here: what only a cluster can show is listed in that section."""

from __future__ import annotations

import configparser
import copy
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import click
import pytest
import yaml
from flask import Flask

from petstore.cli import main
from tests.support.podman import IMAGE, UID
from tests.support.programs import program

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
BASE, EXAMPLE = "base", "overlays/example"
KUSTOMIZATIONS = (BASE, EXAMPLE)
# The Service clients reach (the ready pods) and the one Prometheus finds every pod by.
KINDS = ["ConfigMap", "Deployment", "HorizontalPodAutoscaler", "Job", "PodDisruptionBudget"]
SERVICES = ["petstore", "petstore-pods"]
# The newest Kubernetes kubernetes-validate knows, and the oldest whose kubelet runs the preStop
# `sleep` action by default (beta in 1.30, GA in 1.34).
KUBERNETES_VERSIONS = ("1.37", "1.30")

# The image's side of the deployment contract: its name and its user and group (numeric, so
# that runAsNonRoot can be checked), as tests/support/podman.py has them and test_image checks
# them on the built image; the one path it writes. The pods name no command, so they run the
# image's own CMD (gunicorn with its copy of deploy/gunicorn.conf.py).
IMAGE_UID = IMAGE_GID = UID
WRITABLE_PATHS = {"/tmp"}

# What deploy/gunicorn.conf.py makes of an environment, printed as JSON by a fresh interpreter:
# it changes os.environ (the metrics directory, the pool size), and it exits on a bad setting.
GUNICORN_SETTINGS = """
import json, os, runpy, sys, tempfile
settings = runpy.run_path(sys.argv[1])
print(json.dumps({
    "workers": settings["workers"],
    "bind": settings["bind"],
    "graceful_timeout": settings["graceful_timeout"],
    "worker_tmp_dir": settings.get("worker_tmp_dir"),
    "metrics_dir": os.environ["PROMETHEUS_MULTIPROC_DIR"],
    "tmp": tempfile.gettempdir(),
}))
"""

Objects = list[dict[str, Any]]


@pytest.fixture(scope="module")
def rendered() -> dict[str, Objects]:
    """Each kustomization -> the objects `kubectl kustomize` renders of it."""
    kubectl = program("kubectl")
    objects = {}
    for name in KUSTOMIZATIONS:
        done = subprocess.run(
            [kubectl, "kustomize", str(K8S / name)], capture_output=True, text=True, timeout=60
        )
        assert done.returncode == 0, done.stderr
        objects[name] = [item for item in yaml.safe_load_all(done.stdout) if item]
    return objects


def one(objects: Objects, kind: str, name: str | None = None) -> dict[str, Any]:
    """The object of this kind (and name: for the Services)."""
    (found,) = [
        item
        for item in objects
        if item["kind"] == kind and name in (None, item["metadata"]["name"])
    ]
    return found


def pod_templates(objects: Objects) -> list[dict[str, Any]]:
    """The pod templates: the Deployment's and the Job's."""
    return [one(objects, kind)["spec"]["template"] for kind in ("Deployment", "Job")]


def server(objects: Objects) -> dict[str, Any]:
    """The Deployment's one container."""
    (container,) = one(objects, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def selected(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return selector.items() <= labels.items()


def cores(quantity: str) -> float:
    """A CPU quantity of Kubernetes ("1", "1500m") in cores."""
    return int(quantity[:-1]) / 1000 if quantity.endswith("m") else float(quantity)


def validate(objects: Objects, version: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    rendering = tmp_path / "rendered.yaml"
    rendering.write_text(yaml.safe_dump_all(objects), encoding="utf-8")
    command = ["--strict", "--kubernetes-version", version, str(rendering)]
    return subprocess.run(
        [sys.executable, "-m", "kubernetes_validate", *command],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_kustomize_renders_the_base_and_the_example(rendered: dict[str, Objects]) -> None:
    for objects in rendered.values():
        services = sorted(item["metadata"]["name"] for item in objects if item["kind"] == "Service")
        assert services == SERVICES
        assert sorted(item["kind"] for item in objects if item["kind"] != "Service") == KINDS
    assert {item["metadata"].get("namespace") for item in rendered[BASE]} == {None}
    assert {item["metadata"]["namespace"] for item in rendered[EXAMPLE]} == {"petstore"}
    for kustomization, objects in rendered.items():
        images = {c["image"] for t in pod_templates(objects) for c in t["spec"]["containers"]}
        (image,) = images
        # The base runs the image as `make image` names it; an overlay, its registry's copy.
        assert (image.rpartition(":")[0] == IMAGE) == (kustomization == BASE), image


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_kubernetes_validate_accepts_every_object_strictly(
    rendered: dict[str, Objects], kustomization: str, version: str, tmp_path: Path
) -> None:
    objects = rendered[kustomization]
    validated = validate(objects, version, tmp_path)
    assert validated.returncode == 0, validated.stdout + validated.stderr
    passed = re.findall(r" passed for resource (\S+) against version ", validated.stdout)
    assert len(passed) == len(objects), validated.stdout


def test_kubernetes_validate_refuses_a_field_in_the_wrong_place(
    rendered: dict[str, Objects], tmp_path: Path
) -> None:
    """--strict: the pod's grace period written on the container is refused, not ignored."""
    objects = copy.deepcopy(rendered[BASE])
    server(objects)["terminationGracePeriodSeconds"] = 40
    validated = validate(objects, KUBERNETES_VERSIONS[0], tmp_path)
    assert validated.returncode != 0
    assert "terminationGracePeriodSeconds" in validated.stdout + validated.stderr


def test_every_variable_they_set_is_a_documented_setting(rendered: dict[str, Objects]) -> None:
    page = (ROOT / "docs" / "configuration.rst").read_text(encoding="utf-8")
    settings = set(re.findall(r"^``([A-Z][A-Z0-9_]+)``  ", page, re.M))
    for objects in rendered.values():
        names = set(one(objects, "ConfigMap")["data"])
        for template in pod_templates(objects):
            for container in template["spec"]["containers"]:
                names |= {variable["name"] for variable in container.get("env", [])}
                assert [source["configMapRef"] for source in container["envFrom"]] == [
                    {"name": one(objects, "ConfigMap")["metadata"]["name"]}
                ]
        assert {"DATABASE_URL", "BIND", "WEB_CONCURRENCY"} <= names
        assert sorted(names - settings) == []


@pytest.mark.parametrize("kustomization", KUSTOMIZATIONS)
def test_the_settings_pass_the_services_checks_and_size_gunicorn_to_the_pod(
    rendered: dict[str, Objects], kustomization: str, database_url: str, tmp_path: Path
) -> None:
    """The ConfigMap with the Secret's DATABASE_URL: gunicorn's config takes it as the image does,
    with one worker per core of the CPU limit + 1, listening on the container's port, its files
    under the temporary directory; the grace period outlasts the preStop pause and the drain;
    the Job's environment lets the CLI reach the database."""
    objects = rendered[kustomization]
    environment = {
        **one(objects, "ConfigMap")["data"],
        "PATH": str(Path(sys.executable).parent),
        # /tmp in the pod, the one writable path; here the test's own directory.
        "TMPDIR": str(tmp_path),
        # The Secret's: PostgreSQL itself here, also for the migrations behind a pooler.
        "DATABASE_URL": database_url,
        "PETSTORE_MIGRATION_DATABASE_URL": database_url,
    }
    shown = subprocess.run(
        [sys.executable, "-c", GUNICORN_SETTINGS, str(ROOT / "deploy" / "gunicorn.conf.py")],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
        cwd=ROOT,
    )
    assert shown.returncode == 0, shown.stderr
    gunicorn = json.loads(shown.stdout)
    container = server(objects)
    limits = container["resources"]["limits"]
    assert cores(limits["cpu"]) == int(cores(limits["cpu"])) >= 1
    assert gunicorn["workers"] == int(cores(limits["cpu"])) + 1
    (port,) = container["ports"]
    assert gunicorn["bind"] == [f"0.0.0.0:{port['containerPort']}"]
    assert gunicorn["tmp"] == str(tmp_path)
    assert Path(gunicorn["metrics_dir"]).parent == tmp_path
    # gunicorn's worker heartbeat files go to the temporary directory when it names none.
    assert gunicorn["worker_tmp_dir"] is None

    pod = one(objects, "Deployment")["spec"]["template"]["spec"]
    pause = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert pause >= 5
    assert pod["terminationGracePeriodSeconds"] >= pause + gunicorn["graceful_timeout"] + 5

    (job,) = one(objects, "Job")["spec"]["template"]["spec"]["containers"]
    assert job["command"][:2] == ["petstore", "db"]
    status = subprocess.run(
        ["petstore", "db", "status"],
        capture_output=True,
        text=True,
        timeout=60,
        env=environment,
        cwd=tmp_path,
    )
    assert status.returncode == 0, status.stdout + status.stderr


def test_the_probes_and_the_scrape_ask_routes_of_the_app_on_its_port(
    rendered: dict[str, Objects], app: Flask
) -> None:
    routes = {rule.rule for rule in app.url_map.iter_rules()}
    for objects in rendered.values():
        container = server(objects)
        (port,) = container["ports"]
        probes = {
            name: container[name]["httpGet"]
            for name in ("startupProbe", "readinessProbe", "livenessProbe")
        }
        assert probes["readinessProbe"]["path"] == "/readyz"
        assert probes["livenessProbe"]["path"] == "/healthz"
        assert {probe["path"] for probe in probes.values()} <= routes
        assert {probe["port"] for probe in probes.values()} == {port["name"]}
        annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
        assert annotations["prometheus.io/scrape"] == "true"
        assert annotations["prometheus.io/path"] == "/metrics" in routes
        assert annotations["prometheus.io/port"] == str(port["containerPort"])
        for name in SERVICES:
            (service_port,) = one(objects, "Service", name)["spec"]["ports"]
            assert service_port["targetPort"] == port["name"]


def test_the_pods_run_the_images_command_as_its_user_writing_only_tmp(
    rendered: dict[str, Objects],
) -> None:
    """No command on the Deployment (the image's CMD runs); the Job's is the CLI's `db upgrade`;
    the image's user and group, nothing to escalate to, and /tmp (in memory) the only writable path."""
    scripts = configparser.ConfigParser()
    scripts.read(ROOT / "setup.cfg", encoding="utf-8")
    entry_points = scripts["options.entry_points"]["console_scripts"]
    for objects in rendered.values():
        container = server(objects)
        assert "command" not in container and "args" not in container
        (job,) = one(objects, "Job")["spec"]["template"]["spec"]["containers"]
        program_name, group, command = job["command"]
        assert f"{program_name} = petstore.cli:main" in entry_points
        with click.Context(main) as context:
            db = main.get_command(context, group)
            assert isinstance(db, click.Group)
            assert db.get_command(context, command) is not None
        assert "args" not in job
        for template in pod_templates(objects):
            pod = template["spec"]
            assert pod["securityContext"] == {
                "runAsNonRoot": True,
                "runAsUser": IMAGE_UID,
                "runAsGroup": IMAGE_GID,
                "seccompProfile": {"type": "RuntimeDefault"},
            }
            assert pod["automountServiceAccountToken"] is False
            assert pod["enableServiceLinks"] is False
            assert not {"hostNetwork", "hostPID", "hostIPC"} & set(pod)
            volumes = {volume["name"]: volume for volume in pod["volumes"]}
            for container in pod["containers"]:
                assert container["securityContext"] == {
                    "allowPrivilegeEscalation": False,
                    "readOnlyRootFilesystem": True,
                    "capabilities": {"drop": ["ALL"]},
                }
                mounts = container["volumeMounts"]
                assert {mount["mountPath"] for mount in mounts} == WRITABLE_PATHS
                for mount in mounts:
                    assert set(volumes[mount["name"]]) == {"name", "emptyDir"}
                    assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
                    assert volumes[mount["name"]]["emptyDir"]["sizeLimit"]


def test_the_rollout_keeps_every_pod_and_the_selectors_take_the_servers(
    rendered: dict[str, Objects],
) -> None:
    for objects in rendered.values():
        deployment = one(objects, "Deployment")
        spec = deployment["spec"]
        assert spec["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
        # The autoscaler owns the count: an apply at a release must not reset it.
        assert "replicas" not in spec
        pods = spec["template"]["metadata"]["labels"]
        job_pods = one(objects, "Job")["spec"]["template"]["metadata"]["labels"]
        for selector in (
            spec["selector"]["matchLabels"],
            *(one(objects, "Service", name)["spec"]["selector"] for name in SERVICES),
            one(objects, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"],
        ):
            assert selected(selector, pods) and not selected(selector, job_pods)
        autoscaler = one(objects, "HorizontalPodAutoscaler")["spec"]
        assert autoscaler["scaleTargetRef"] == {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "name": deployment["metadata"]["name"],
        }
        (metric,) = autoscaler["metrics"]
        assert metric["resource"]["name"] == "cpu"
        # A drain (one pod at a time) always leaves a pod serving.
        disruption = one(objects, "PodDisruptionBudget")["spec"]
        assert autoscaler["minReplicas"] > disruption["maxUnavailable"]
        assert server(objects)["resources"]["requests"]["cpu"]


def test_prometheus_finds_every_server_pod_in_dns_and_scrapes_its_port(
    rendered: dict[str, Objects],
) -> None:
    """deploy/k8s/prometheus.yml: the job of deploy/prometheus.yml (whose alerts then apply), on the
    example's headless Service, which names every pod of the Deployment, ready or not (a pod that
    lost PostgreSQL is out of the other Service, and its metrics say why), none of the Job's."""
    scrape = yaml.safe_load((K8S / "prometheus.yml").read_text(encoding="utf-8"))
    static = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text(encoding="utf-8"))
    (job,) = scrape["scrape_configs"]
    (static_job,) = static["scrape_configs"]
    assert job["job_name"] == static_job["job_name"]
    assert scrape["rule_files"] == static["rule_files"]
    objects = rendered[EXAMPLE]
    pods = one(objects, "Service", "petstore-pods")
    namespace = pods["metadata"]["namespace"]
    (discovery,) = job["dns_sd_configs"]
    assert discovery["names"] == [f"petstore-pods.{namespace}.svc.cluster.local"]
    assert discovery["type"] == "A"
    (port,) = server(objects)["ports"]
    assert discovery["port"] == port["containerPort"]
    annotations = one(objects, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert job["metrics_path"] == annotations["prometheus.io/path"]
    assert pods["spec"]["clusterIP"] == "None"
    assert pods["spec"]["publishNotReadyAddresses"] is True


def test_the_guides_commands_name_these_objects(rendered: dict[str, Objects]) -> None:
    """docs/deploying.rst, "On Kubernetes": the namespace and the Secret it creates are those the
    example uses, and the release's first step selects the settings and the Job, nothing else."""
    guide = (ROOT / "docs" / "deploying.rst").read_text(encoding="utf-8")
    objects = rendered[EXAMPLE]
    namespace = one(objects, "Deployment")["metadata"]["namespace"]
    assert f"kubectl create namespace {namespace}\n" in guide
    references = {
        (
            variable["valueFrom"]["secretKeyRef"]["name"],
            variable["valueFrom"]["secretKeyRef"]["key"],
        )
        for template in pod_templates(objects)
        for container in template["spec"]["containers"]
        for variable in container.get("env", [])
        if "secretKeyRef" in variable.get("valueFrom", {})
    }
    assert references
    for secret, key in references:
        assert f"-n {namespace} create secret generic {secret} " in guide
        assert f"--from-literal={key}='" in guide
    job = one(objects, "Job")["metadata"]["name"]
    assert f"kubectl -n {namespace} delete job {job} --ignore-not-found\n" in guide
    assert f"--for=condition=complete --timeout=65m job/{job}\n" in guide
    assert one(objects, "Job")["spec"]["activeDeadlineSeconds"] <= 65 * 60
    (step,) = re.findall(rf"kubectl apply -k deploy/k8s/{EXAMPLE} -l '([^']+)'\n", guide)
    selector = re.fullmatch(r"([\w./-]+) in \(([\w.,-]+)\)", step)
    assert selector, step
    key, values = selector.groups()
    chosen = [
        item["kind"] for item in objects if item["metadata"]["labels"].get(key) in values.split(",")
    ]
    assert sorted(chosen) == ["ConfigMap", "Job"]

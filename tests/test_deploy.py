"""The Kubernetes manifests (deploy/kubernetes): every overlay renders, validates offline against
the schemas of two Kubernetes versions, and agrees with the server it runs (flags, configuration,
health service, ports, metrics, drain timing)."""

from __future__ import annotations

import copy
import shlex
from pathlib import Path

import jsonpatch
import kubernetes_validate
import pytest
import yaml

from audio_pipeline.cli import build_parser
from audio_pipeline.config import AudioGenerationConfig
from audio_pipeline.core.metrics import EngineMetrics
from audio_pipeline.server.app import SERVICE_NAME

ROOT = Path(__file__).resolve().parent.parent
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.parent for p in (KUBERNETES / "overlays").glob("*/kustomization.yaml"))


def newest_versions(count: int = 2) -> list[str]:
    """The newest Kubernetes versions whose strict schemas the installed kubernetes-validate ships."""
    schemas = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    found = [p.name[1:-len("-local-strict")] for p in schemas.glob("v*-local-strict")]
    return sorted(found, key=lambda v: tuple(int(x) for x in v.split(".")))[-count:]


#: Two recent Kubernetes versions (kubernetes-validate 1.37 ships 1.36 and 1.37 among others).
VERSIONS = newest_versions()
#: The kustomize fields the manifests use; render() refuses others rather than ignore them.
FIELDS = {"apiVersion", "kind", "resources", "images", "patches"}


def render(directory: Path) -> list[dict]:
    """What ``kubectl kustomize DIRECTORY`` prints, for the fields the manifests use: resources
    (files and bases), images (newName/newTag) and JSON 6902 patches with a kind/name target."""
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - FIELDS
    assert not unknown, f"{directory}: kustomize fields this test cannot render: {unknown}"
    documents: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        documents += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    for image in kustomization.get("images", []):
        for document in documents:
            for container in containers(document):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        matches = [i for i, d in enumerate(documents)
                   if d["kind"] == target["kind"] and d["metadata"]["name"] == target["name"]]
        assert matches, f"{directory}: patch target {target} matches nothing"
        for i in matches:
            documents[i] = jsonpatch.apply_patch(copy.deepcopy(documents[i]), yaml.safe_load(patch["patch"]))
    return documents


def containers(document: dict) -> list[dict]:
    return document.get("spec", {}).get("template", {}).get("spec", {}).get("containers", [])


def by_kind(documents: list[dict], kind: str) -> dict:
    (document,) = [d for d in documents if d["kind"] == kind]
    return document


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
@pytest.mark.parametrize("version", VERSIONS)
def test_every_overlay_renders_and_passes_schema_validation(overlay, version):
    documents = render(overlay)
    assert {d["kind"] for d in documents} >= {"Deployment", "Service", "HorizontalPodAutoscaler",
                                               "PodDisruptionBudget", "ConfigMap", "PersistentVolumeClaim"}
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)


def test_there_are_cpu_and_gpu_overlays_with_their_images():
    assert [p.name for p in OVERLAYS] == ["cpu", "gpu"]
    for overlay in OVERLAYS:
        (container,) = containers(by_kind(render(overlay), "Deployment"))
        assert container["image"].endswith(f":{'cuda' if overlay.name == 'gpu' else 'cpu'}")
    (gpu,) = containers(by_kind(render(KUBERNETES / "overlays" / "gpu"), "Deployment"))
    assert gpu["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert gpu["args"][-2:] == ["--device", "cuda"]


@pytest.mark.parametrize("overlay", OVERLAYS, ids=lambda p: p.name)
def test_manifests_agree_with_the_server_they_run(overlay, tmp_path):
    documents = render(overlay)
    deployment = by_kind(documents, "Deployment")
    pod = deployment["spec"]["template"]
    (container,) = containers(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}

    # The arguments are the server's own flags (the image's entrypoint is `audio-pipeline serve`).
    args = build_parser().parse_args(["serve", *container["args"]])
    assert (args.port, args.http_port, args.metrics_port) == (ports["grpc"], ports["http"], ports["metrics"])
    # The mounted configuration file is a valid configuration of this server.
    config_text = by_kind(documents, "ConfigMap")["data"]["config.yaml"]
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["config"]
    assert args.config_file == f"{mount}/config.yaml"
    (tmp_path / "config.yaml").write_text(config_text)
    config = AudioGenerationConfig.load(config_file=str(tmp_path / "config.yaml"), env={})
    assert config.grace_period_s > 0

    # Native gRPC probes against the standard health service, on the gRPC port.
    assert container["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": SERVICE_NAME}
    assert container["startupProbe"]["grpc"]["port"] == ports["grpc"]
    assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"]}  # "": the whole server

    # A rolling update drains: the pod gets the preStop pause plus the server's grace period.
    pause = int(shlex.join(container["lifecycle"]["preStop"]["exec"]["command"]).split()[-1])
    assert pod["spec"]["terminationGracePeriodSeconds"] >= pause + config.grace_period_s + 5
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0

    # Prometheus finds /metrics where the server serves it.
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true"
    assert int(annotations["prometheus.io/port"]) == ports["metrics"] and annotations["prometheus.io/path"] == "/metrics"
    # The autoscaler's metric is one the engine exports.
    metric = by_kind(documents, "HorizontalPodAutoscaler")["spec"]["metrics"][0]["pods"]["metric"]["name"]
    assert EngineMetrics().registry.get_sample_value(metric) is not None

    # Every selector picks these pods; the headless service is there for client-side balancing.
    labels = pod["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert by_kind(documents, "PodDisruptionBudget")["spec"]["selector"]["matchLabels"].items() <= labels.items()
    services = [d for d in documents if d["kind"] == "Service"]
    assert all(s["spec"]["selector"].items() <= labels.items() for s in services)
    assert [s["spec"].get("clusterIP") for s in services].count("None") == 1
    # Model weights come from the shared volume, read-only.
    claim = by_kind(documents, "PersistentVolumeClaim")["metadata"]["name"]
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim
    assert args.model.startswith({m["name"]: m["mountPath"] for m in container["volumeMounts"]}["models"] + "/")


def test_the_image_copies_what_the_package_needs_and_runs_the_server():
    dockerfile = (ROOT / "deploy" / "docker" / "Dockerfile").read_text()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            for source in line.split()[1:-1]:
                assert (ROOT / source).exists(), line
    assert 'ENTRYPOINT ["audio-pipeline", "serve"]' in dockerfile
    assert 'audio-pipeline = "audio_pipeline.cli:main"' in (ROOT / "pyproject.toml").read_text()

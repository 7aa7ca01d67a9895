"""The Kubernetes manifests under deploy/kubernetes: rendered with ``kubectl kustomize``,
validated offline against the Kubernetes JSON schemas, and checked for what the
deployment promises (the systemd unit's hardening, GPU-node placement, probes, the
rules and dashboard copied from prometheus/ and grafana/, configs the daemon accepts).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from types import ModuleType
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = ("base", "fleet")
#: The oldest Kubernetes minor the manifests must be valid for.
KUBERNETES_VERSION = "1.30"
#: Prometheus Operator CRDs: kubernetes-validate ships only the built-in kinds' schemas,
#: so these are checked by the structural tests below instead of a schema.
CRD_KINDS = frozenset({"ServiceMonitor", "PrometheusRule"})
Doc = dict[str, Any]


def _render(overlay: str) -> list[Doc]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.fail("kubectl not found: scripts/install-test-deps.sh installs it")
    out = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    return [d for d in yaml.safe_load_all(out) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Doc]]:
    return {overlay: _render(overlay) for overlay in OVERLAYS}


def _one(docs: list[Doc], kind: str) -> Doc:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def _generate_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("k8s_generate", DEPLOY / "generate.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _container(ds: Doc, name: str = "gpuwatchd") -> Doc:
    pod = ds["spec"]["template"]["spec"]
    return next(c for c in pod["containers"] if c["name"] == name)


def _config(docs: list[Doc]) -> dict[str, Any]:
    cm = next(d for d in docs if d["metadata"]["name"].startswith("gpuwatchd-config-"))
    return tomllib.loads(cm["data"]["config.toml"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_schemas(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    kinds = {d["kind"] for d in docs}
    assert {"Namespace", "DaemonSet", "Service", "ConfigMap"} <= kinds
    assert kinds >= CRD_KINDS
    for doc in docs:
        if doc["kind"] in CRD_KINDS:
            continue
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


def test_validation_rejects_a_broken_daemonset(rendered: dict[str, list[Doc]]) -> None:
    ds = json.loads(json.dumps(_one(rendered["base"], "DaemonSet")))
    _container(ds)["securityContext"]["readOnlyRootFilesystem"] = "yes"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(ds, KUBERNETES_VERSION, strict=True)


def test_generated_copies_are_current() -> None:
    assert _generate_module().stale_files() == []


def test_prometheus_rule_carries_the_fleet_alerts(rendered: dict[str, list[Doc]]) -> None:
    rule = _one(rendered["fleet"], "PrometheusRule")
    groups = {g["name"]: g for g in rule["spec"]["groups"]}
    fleet = {r["alert"] for r in groups["gpuwatchd-fleet"]["rules"]}
    assert fleet == {"GpuwatchdHostSlowerThanFleet", "GpuwatchdFleetDisagreement"}


def test_prometheus_rule_groups_equal_the_alerts_file(rendered: dict[str, list[Doc]]) -> None:
    alerts = yaml.safe_load((ROOT / "prometheus" / "alerts.yml").read_text(encoding="utf-8"))
    for docs in rendered.values():
        rule = _one(docs, "PrometheusRule")
        assert rule["apiVersion"] == "monitoring.coreos.com/v1"
        assert rule["metadata"]["namespace"] == "gpuwatchd"
        assert rule["spec"]["groups"] == alerts["groups"]


def test_dashboard_configmap_is_the_dashboard_with_the_sidecar_label(
    rendered: dict[str, list[Doc]],
) -> None:
    cm = next(d for d in rendered["base"] if d["metadata"]["name"] == "gpuwatchd-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    # The per-host and the fleet dashboard, each under its file's name.
    assert set(cm["data"]) == {"gpuwatchd.json", "gpuwatchd-fleet.json"}
    for key, text in cm["data"].items():
        dashboard = json.loads((ROOT / "grafana" / key).read_text(encoding="utf-8"))
        assert json.loads(text) == dashboard, key
    uids = {json.loads(text)["uid"] for text in cm["data"].values()}
    assert uids == {"gpuwatchd", "gpuwatchd-fleet"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_daemonset_runs_on_gpu_nodes_without_taking_a_gpu(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    pod = _one(rendered[overlay], "DaemonSet")["spec"]["template"]["spec"]
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod[
        "tolerations"
    ]
    assert pod["hostPID"] is True  # NVML's PIDs are the host's
    for c in pod["containers"] + pod["initContainers"]:
        for part in ("requests", "limits"):
            assert "nvidia.com/gpu" not in c.get("resources", {}).get(part, {})
    env = {e["name"]: e for e in _container({"spec": {"template": {"spec": pod}}})["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"]["value"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"]["value"] == "utility,compute"
    # the host's name in a shared store is the node's: a pod's name changes on restart
    assert env["GPUWATCHD_HOST"]["valueFrom"] == {"fieldRef": {"fieldPath": "spec.nodeName"}}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_daemon_is_hardened_like_the_systemd_unit(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    ds = _one(rendered[overlay], "DaemonSet")
    pod = ds["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = _container(ds)["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] != 0
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["allowPrivilegeEscalation"] is False
    assert sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    # The only root step: handing the hostPath directories to the daemon's uid.
    (init,) = pod["initContainers"]
    isc = init["securityContext"]
    assert isc["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert isc["allowPrivilegeEscalation"] is False and isc["readOnlyRootFilesystem"] is True
    assert f"chown {sc['runAsUser']}:{sc['runAsGroup']} /var/lib/gpuwatchd" in init["command"][-1]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_writable_paths_are_the_configured_ones(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    ds = _one(docs, "DaemonSet")
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    mounts = {m["mountPath"]: m for m in _container(ds)["volumeMounts"]}
    daemon = _config(docs)["daemon"]
    state = mounts[daemon["state_dir"]]
    assert volumes[state["name"]]["hostPath"]["path"] == daemon["state_dir"]
    run_dir = str(Path(daemon["control_socket"]).parent)
    assert volumes[mounts[run_dir]["name"]]["hostPath"] == {
        "path": "/run/gpuwatchd",
        "type": "DirectoryOrCreate",
    }
    assert mounts["/etc/gpuwatchd"]["readOnly"] is True
    # Everything else the daemon writes is an emptyDir, never the read-only root.
    assert "emptyDir" in volumes[mounts["/tmp"]["name"]]
    env = {e["name"]: e["value"] for e in _container(ds)["env"] if "value" in e}
    cache = mounts["/var/cache/gpuwatchd"]
    assert "emptyDir" in volumes[cache["name"]]
    assert env["CACHE_DIRECTORY"] == "/var/cache/gpuwatchd"  # the worker's caches go there


def test_probes_hit_the_health_route_on_the_listen_port(rendered: dict[str, list[Doc]]) -> None:
    routes = (ROOT / "gpuwatchd" / "serve" / "routes.py").read_text(encoding="utf-8")
    assert '"/healthz": self._healthz' in routes
    docs = rendered["base"]
    c = _container(_one(docs, "DaemonSet"))
    (port,) = c["ports"]
    assert f":{port['containerPort']}" == _config(docs)["daemon"]["listen"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": port["name"]}


def test_service_and_servicemonitor_select_the_daemon(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["base"]
    ds = _one(docs, "DaemonSet")
    pod_labels = ds["spec"]["template"]["metadata"]["labels"]
    svc = _one(docs, "Service")
    assert svc["spec"]["clusterIP"] == "None"  # one target per node, not a balanced VIP
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    (svc_port,) = svc["spec"]["ports"]
    assert svc_port["targetPort"] == _container(ds)["ports"][0]["name"]
    sm = _one(docs, "ServiceMonitor")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] == svc_port["name"] and endpoint["path"] == "/metrics"


def test_base_config_is_accepted_by_check_config(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    cm = next(d for d in rendered["base"] if d["metadata"]["name"].startswith("gpuwatchd-config-"))
    path = tmp_path / "config.toml"
    path.write_text(cm["data"]["config.toml"], encoding="utf-8")
    _check_config(path)
    path.write_text(cm["data"]["config.toml"] + "poll_interval_s = 7\n", encoding="utf-8")
    with pytest.raises(AssertionError, match="poll_interval_s"):
        _check_config(path)


#: `gpuwatchd check-config` through this interpreter (the console script may be elsewhere).
CHECK_CONFIG = "import sys; from gpuwatchd.cli.main import main; sys.exit(main(sys.argv[1:]))"


def _check_config(path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", CHECK_CONFIG, "check-config", "--config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_fleet_reads_the_store_password_from_the_secret(rendered: dict[str, list[Doc]]) -> None:
    docs = rendered["fleet"]
    store = _config(docs)["store"]
    assert store["url"].startswith("postgresql://")
    assert ":" not in store["url"].split("://", 1)[1].split("@", 1)[0]  # no password in it
    ds = _one(docs, "DaemonSet")
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    secret_mount = next(m for m in _container(ds)["volumeMounts"] if "secret" in volumes[m["name"]])
    assert volumes[secret_mount["name"]]["secret"]["secretName"] == "gpuwatchd-postgres"
    assert Path(store["password_file"]).parent == Path(secret_mount["mountPath"])
    assert f"sslrootcert={secret_mount['mountPath']}/ca.crt" in store["url"]
    assert not any(d["kind"] == "Secret" for d in docs)  # no credential in the tree


def test_fleet_config_is_accepted_by_check_config(
    rendered: dict[str, list[Doc]], tmp_path: Path
) -> None:
    cm = next(d for d in rendered["fleet"] if d["metadata"]["name"].startswith("gpuwatchd-config-"))
    text = cm["data"]["config.toml"]
    # check-config reads the password file: the Secret's mount stands in as a temp file.
    secret = tomllib.loads(text)["store"]["password_file"]
    password = tmp_path / "password"
    password.write_text("from-the-secret\n", encoding="utf-8")
    path = tmp_path / "config.toml"
    path.write_text(text.replace(f'"{secret}"', f'"{password}"'), encoding="utf-8")
    _check_config(path)


# -- the fleet's pooler, priority, network policy and placement overrides ---------------------


def _named(docs: list[Doc], kind: str, name: str) -> Doc:
    return next(d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name)


def _pgbouncer_ini(docs: list[Doc]) -> dict[str, dict[str, str]]:
    import configparser

    cm = next(d for d in docs if d["metadata"]["name"].startswith("gpuwatchd-pgbouncer-"))
    ini = configparser.ConfigParser(inline_comment_prefixes=(";",))
    ini.read_string(cm["data"]["pgbouncer.ini"])
    return {section: dict(ini[section]) for section in ini.sections()}


def test_the_fleet_reaches_its_store_through_pgbouncer_in_transaction_mode(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["fleet"]
    ini = _pgbouncer_ini(docs)
    assert ini["pgbouncer"]["pool_mode"] == "transaction"
    pool, clients = (int(ini["pgbouncer"][k]) for k in ("default_pool_size", "max_client_conn"))
    assert clients >= 1000 and pool <= clients / 10  # 1,000 hosts: <= 1 server conn per 10
    assert "host=gpuwatchd-postgres" in ini["databases"]["gpuwatchd"]
    deploy = _named(docs, "Deployment", "gpuwatchd-pgbouncer")
    pod = deploy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert container["securityContext"]["runAsNonRoot"] is True
    service = _named(docs, "Service", "gpuwatchd-pgbouncer")
    (port,) = service["spec"]["ports"]
    assert service["spec"]["selector"] == deploy["spec"]["template"]["metadata"]["labels"]
    url = _config(docs)["store"]["url"]
    assert url.startswith(f"postgresql://gpuwatchd@gpuwatchd-pgbouncer:{port['port']}/")
    assert "sslmode=verify-ca" in url
    secrets = {v["secret"]["secretName"] for v in pod["volumes"] if "secret" in v}
    assert secrets == {"gpuwatchd-pgbouncer", "gpuwatchd-postgres"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_daemon_has_a_priority_class_of_its_own(
    rendered: dict[str, list[Doc]], overlay: str
) -> None:
    docs = rendered[overlay]
    name = _one(docs, "DaemonSet")["spec"]["template"]["spec"]["priorityClassName"]
    assert name != "system-node-critical"  # reserved to kube-system by default
    assert _named(docs, "PriorityClass", name)["globalDefault"] is False


def test_the_api_and_the_pooler_are_fenced_by_network_policies(
    rendered: dict[str, list[Doc]],
) -> None:
    docs = rendered["fleet"]
    ds = _one(docs, "DaemonSet")
    api = _named(docs, "NetworkPolicy", "gpuwatchd-api")
    assert api["spec"]["podSelector"]["matchLabels"] == ds["spec"]["selector"]["matchLabels"]
    ((rule,),) = [api["spec"]["ingress"]]
    assert rule["ports"] == [{"port": "http-metrics", "protocol": "TCP"}]
    pooler = _named(docs, "NetworkPolicy", "gpuwatchd-pgbouncer")
    ((only,),) = [pooler["spec"]["ingress"]]
    assert only["from"] == [{"podSelector": {"matchLabels": ds["spec"]["selector"]["matchLabels"]}}]
    assert only["ports"] == [{"port": "postgres", "protocol": "TCP"}]


def test_the_placement_example_overrides_the_node_label_and_the_runtime_class() -> None:
    docs = _render("examples/placement")
    for doc in docs:
        if doc["kind"] not in CRD_KINDS:
            kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)
    pod = _one(docs, "DaemonSet")["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"example.com/accelerator": "nvidia"}
    assert "runtimeClassName" not in pod


def test_the_fleet_daemon_reads_the_nodes_machine_id(rendered: dict[str, list[Doc]]) -> None:
    ds = _one(rendered["fleet"], "DaemonSet")
    volumes = {v["name"]: v for v in ds["spec"]["template"]["spec"]["volumes"]}
    mount = next(m for m in _container(ds)["volumeMounts"] if m["mountPath"] == "/etc/machine-id")
    assert mount["readOnly"] is True
    assert volumes[mount["name"]]["hostPath"] == {"path": "/etc/machine-id", "type": "File"}

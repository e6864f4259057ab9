"""k8s/: every overlay renders (kustomize, from kubectl) and every object validates against the
real schemas (Kubernetes built-ins with kubernetes-validate --strict; the KubeRay kinds against
the operator's CRD schemas, made strict), and what the manifests name matches the code: ports,
probe paths (called on the real front doors), env vars, the config file (`brigade serve
--check`), drain timing, worker placement, Ray auth, and the image's install steps.

Offline and fast: nothing is built or pulled, no cluster is started.
"""
from __future__ import annotations

import copy
import json
import os
import platform
import re
import select
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from functools import cache
from pathlib import Path

import grpc
import jsonschema
import kubernetes_validate
import pytest
import redis as redis_py
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc
from support import wait_for

from cluster.cli import main as brigade
from cluster.config import ClusterConfig, load_config, redis_url_with_password
from cluster.launch import local_resources
from cluster.redis_server import EmbeddedRedis
from kv_transfer import TransferConfig
from router.config import AuthConfig, FrontDoorConfig
from router.grpc.server import GrpcServer
from router.http.server import ApiServer
from router.metrics import FrontDoorMetrics
from tests.shared_data import shared_data

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
OVERLAYS = ["cpu-dev", "gpu-prod", "gpu-prod-monitoring"]
KUBERNETES_VERSION = "1.33.0"  # the schemas kubernetes-validate (pinned in pyproject) checks against
POD_IP = "10.1.2.3"  # stands in for $(POD_IP) when the head container's args are checked


# -- rendering and schemas -----------------------------------------------------------------------

def kubectl() -> str:
    found = shutil.which("kubectl", path=str(Path(sys.executable).parent)) or shutil.which("kubectl")
    if found is None:
        if platform.machine() not in ("x86_64", "AMD64"):
            pytest.skip(f"needs kubectl >= 1.27 on PATH (k8s/tools/install_kubectl.py is x86_64 only; "
                        f"this is {platform.machine()})")
        pytest.fail("kubectl not found: run `make dev` (it installs .venv/bin/kubectl, k8s/tools/install_kubectl.py)")
    return found


@cache
def rendered(overlay: str) -> tuple[dict, ...]:
    out = subprocess.run([kubectl(), "kustomize", str(K8S / "overlays" / overlay)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d)


def one(docs, kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"{kind} {name}: {len(found)} found"
    return found[0]


def _strict(schema):
    """A CRD's OpenAPI schema with unknown fields refused (the API server would silently drop
    them, so a misspelt field would pass unnoticed otherwise)."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


@cache
def crd_validators() -> dict[tuple[str, str], jsonschema.Validator]:
    out = {}
    for path in sorted(shared_data("kuberay-crds").glob("*.yaml")):
        crd = yaml.safe_load(path.read_text())
        for version in crd["spec"]["versions"]:
            key = (f"{crd['spec']['group']}/{version['name']}", crd["spec"]["names"]["kind"])
            out[key] = jsonschema.Draft7Validator(_strict(version["schema"]["openAPIV3Schema"]))
    return out


def validate(doc: dict) -> None:
    if doc["apiVersion"].startswith("ray.io/"):
        validator = crd_validators().get((doc["apiVersion"], doc["kind"]))
        assert validator is not None, f"no KubeRay CRD schema for {doc['apiVersion']} {doc['kind']}"
        errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)]
        assert not errors, f"{doc['kind']} {doc['metadata']['name']}: " + "; ".join(errors[:5])
    elif doc["apiVersion"] == "monitoring.coreos.com/v1":  # no schema here: the fields the test relies on
        assert doc["kind"] == "ServiceMonitor" and doc["spec"]["endpoints"] and doc["spec"]["selector"]
    else:
        kubernetes_validate.validate(doc, KUBERNETES_VERSION, strict=True)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_of_every_overlay_validates(overlay: str) -> None:
    docs = rendered(overlay)
    kinds = {d["kind"] for d in docs}
    assert {"RayCluster", "StatefulSet", "Service", "ConfigMap", "PodDisruptionBudget", "NetworkPolicy"} <= kinds
    for doc in docs:
        validate(doc)
    assert ("ServiceMonitor" in kinds) == (overlay == "gpu-prod-monitoring")


def test_the_validators_refuse_a_misspelt_field() -> None:
    """Both validators are strict: the test above would catch a typo."""
    docs = rendered("cpu-dev")
    ray = copy.deepcopy(one(docs, "RayCluster"))
    ray["spec"]["workerGroupSpecs"][0]["replica"] = 2
    with pytest.raises(AssertionError, match="replica"):
        validate(ray)
    ray = copy.deepcopy(one(docs, "RayCluster"))
    ray["spec"]["headGroupSpec"]["template"]["spec"]["containers"][1]["readinessProbe"]["httpGet"]["paht"] = "/"
    with pytest.raises(AssertionError, match="paht"):
        validate(ray)
    redis = copy.deepcopy(one(docs, "StatefulSet", "brigade-redis"))
    redis["spec"]["template"]["spec"]["containers"][0]["imagePullPolcy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(redis)


# -- the head pod against the code ---------------------------------------------------------------

def head(docs) -> dict:
    return one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]


def container(pod: dict, name: str) -> dict:
    return next(c for c in pod["containers"] if c["name"] == name)


def config_of(docs, tmp_path: Path) -> tuple[Path, ClusterConfig]:
    text = one(docs, "ConfigMap", "brigade-config")["data"]["cluster.yaml"]
    path = tmp_path / "cluster.yaml"
    path.write_text(text)
    return path, load_config(path, {})


def serve_args(docs) -> list[str]:
    """`brigade serve`'s argv in the head pod: the command waits for the GCS at --ray-address,
    then execs `brigade serve` with the container's args."""
    brigade_c = container(head(docs), "brigade")
    shell, flag, script, _name = brigade_c["command"]
    assert (shell, flag) == ("sh", "-c") and script.rstrip().endswith('exec brigade serve "$@"')
    args = brigade_c["args"]
    assert f'--address "{args[args.index("--ray-address") + 1].replace("$(POD_IP)", "$POD_IP")}"' in script
    mount = next(m for m in brigade_c["volumeMounts"] if m["name"] == "config")
    config_volume = next(v for v in head(docs)["volumes"] if v["name"] == "config")
    assert config_volume["configMap"]["name"] == "brigade-config"
    args = ["serve", *(a.replace("$(POD_IP)", POD_IP) for a in brigade_c["args"])]
    assert args[args.index("--config") + 1] == f"{mount['mountPath']}/cluster.yaml"
    return args


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_configmap_passes_serve_check(overlay: str, tmp_path: Path, monkeypatch, capsys) -> None:
    docs = rendered(overlay)
    path, cfg = config_of(docs, tmp_path)
    args = serve_args(docs)
    args[args.index("--config") + 1] = str(path)
    for name in (cfg.redis_password_env, cfg.frontdoor.auth.token_env):  # the Secrets' values, in the pod
        monkeypatch.setenv(name, "tenant-a a-secret-value-0123456789")
    pod_env = {e["name"]: e.get("value") for e in container(head(docs), "brigade")["env"]}
    monkeypatch.setenv("RAY_AUTH_MODE", pod_env["RAY_AUTH_MODE"])
    assert brigade([*args, "--check"]) == 0
    out = capsys.readouterr().out
    assert "# config OK" in out and f"host: {POD_IP}" in out and "a-secret-value" not in out
    assert cfg.transfer.host == "node"  # workers on different pods: each binds its own address

    monkeypatch.delenv(cfg.redis_password_env)
    with pytest.raises(SystemExit) as exit_:
        brigade([*args, "--check"])
    assert exit_.value.code == 2
    assert f"${cfg.redis_password_env}, which is unset" in capsys.readouterr().err

    monkeypatch.setenv(cfg.redis_password_env, "a-secret-value-0123456789")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # the pod's --host and --ray-address need Ray token auth
    with pytest.raises(SystemExit) as exit_:
        brigade([*args, "--check"])
    assert exit_.value.code == 2 and "RAY_AUTH_MODE" in capsys.readouterr().err


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_and_services_match_the_config(overlay: str, tmp_path: Path) -> None:
    docs = rendered(overlay)
    _, cfg = config_of(docs, tmp_path)
    ports = {p["name"]: p["containerPort"] for p in container(head(docs), "brigade")["ports"]}
    assert ports == {"http": cfg.http_port, "grpc": cfg.grpc_port}
    front = one(docs, "Service", "brigade")
    assert {(p["name"], p["port"], p["targetPort"]) for p in front["spec"]["ports"]} == {
        ("http", cfg.http_port, "http"), ("grpc", cfg.grpc_port, "grpc")}
    metrics = one(docs, "Service", "brigade-metrics")  # /metrics is on the HTTP door's port
    assert [(p["name"], p["targetPort"]) for p in metrics["spec"]["ports"]] == [("metrics", "http")]
    for svc in (front, metrics):
        assert svc["spec"]["selector"] == {"ray.io/cluster": "brigade", "ray.io/node-type": "head"}
    assert one(docs, "RayCluster")["metadata"]["name"] == "brigade"
    if overlay == "gpu-prod-monitoring":
        endpoint = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
        assert (endpoint["port"], endpoint["path"]) == ("metrics", "/metrics")
        assert one(docs, "ServiceMonitor")["spec"]["selector"]["matchLabels"].items() <= \
            metrics["metadata"]["labels"].items()


class StandIn:
    """The backend both doors ask for health; `ok` is what the cluster would say."""

    model_name, max_model_len = "stand-in", 64

    def __init__(self) -> None:
        self.ok = True

    async def health(self):
        return self.ok, {"waiting": 0, "running": 0}


def probe_answer(probe: dict, ports: dict, cfg: ClusterConfig, http: ApiServer, grpc_door: GrpcServer) -> bool:
    """Calls what the kubelet would call, on the door the probe's port belongs to."""
    if "httpGet" in probe:
        port = ports.get(probe["httpGet"]["port"], probe["httpGet"]["port"])
        assert port == cfg.http_port, f"{probe}: not the HTTP door's port"
        try:
            with urllib.request.urlopen(f"{http.url}{probe['httpGet']['path']}", timeout=10) as resp:
                return resp.status == 200
        except urllib.error.HTTPError:  # 503: not ready
            return False
    port = ports.get(probe["grpc"]["port"], probe["grpc"]["port"])
    assert port == cfg.grpc_port, f"{probe}: not the gRPC door's port"
    with grpc.insecure_channel(grpc_door.address) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=probe["grpc"].get("service", "")), timeout=10)
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_probes_call_the_real_doors(tmp_path: Path) -> None:
    docs = rendered("gpu-prod")
    _, cfg = config_of(docs, tmp_path)
    brigade_c = container(head(docs), "brigade")
    ports = {p["name"]: p["containerPort"] for p in brigade_c["ports"]}
    probes = {k: brigade_c[k] for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {"httpGet", "grpc"} <= {kind for p in probes.values() for kind in p if kind in ("httpGet", "grpc")}

    backend = StandIn()
    http = ApiServer("127.0.0.1", 0, FrontDoorConfig(), metrics=FrontDoorMetrics())  # the manifests' auth keeps
    http.backend = backend  # public_health: probes carry no token
    threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
    grpc_door = GrpcServer("127.0.0.1", 0, FrontDoorConfig(), FrontDoorMetrics(), health_interval_s=0.05)
    try:
        grpc_door.attach(backend)
        assert all(probe_answer(p, ports, cfg, http, grpc_door) for p in probes.values())
        backend.ok = False  # no live worker of a role: both doors say so, readiness takes the pod out
        grpc_door.attach(backend)
        # /health answers from a cache of HEALTH_CACHE_S: the probes see the change once it expires.
        wait_for(lambda: not any(probe_answer(p, ports, cfg, http, grpc_door) for p in probes.values()),
                 timeout_s=5.0, what="every probe failing once no worker is live")
        backend.ok = True
        http.draining.set()  # SIGTERM: /health answers 503 from the first moment of a drain
        assert not probe_answer(probes["readinessProbe"], ports, cfg, http, grpc_door)
    finally:
        grpc_door.close()
        http.shutdown()
        http.server_close()
    assert cfg.frontdoor.auth.public_health  # else the kubelet's unauthenticated probes would fail


def test_drain_fits_the_grace_period(tmp_path: Path) -> None:
    docs = rendered("gpu-prod")
    pod = head(docs)
    drain_s = config_of(docs, tmp_path)[1].drain_s  # what the pod's brigade serve will wait
    grace = pod["terminationGracePeriodSeconds"]

    def pre_stop(name: str) -> float:
        command = container(pod, name)["lifecycle"]["preStop"]["exec"]["command"]
        assert command[0] == "sleep"
        return float(command[1])

    # cluster/serve.py: HTTP requests in flight get drain_s, the gRPC door drain_s + 10, then the
    # actors stop (up to 10 s a worker; 3 workers' worth of slack).
    drained = pre_stop("brigade") + drain_s + 10
    assert pre_stop("ray-head") >= drained  # Ray outlives the drain
    assert grace >= drained + 30 and grace > pre_stop("ray-head")


def test_every_env_var_set_is_one_the_code_reads(tmp_path: Path) -> None:
    docs = rendered("gpu-prod")
    _, cfg = config_of(docs, tmp_path)
    ray_dir = Path(__import__("ray").__file__).parent
    ray_sources = "".join(p.read_text(errors="ignore") for p in (ray_dir / "_private").rglob("*.py"))
    ours = "".join(p.read_text() for d in ("cluster", "router", "engine") for p in (ROOT / d).rglob("*.py"))
    ray = one(docs, "RayCluster")["spec"]
    pods = [ray["headGroupSpec"]["template"]["spec"], *[g["template"]["spec"] for g in ray["workerGroupSpecs"]]]
    checked = 0
    for pod in pods:
        for c in pod["containers"]:
            args = " ".join(c.get("args", []))
            for env in c.get("env", []):
                name = env["name"]
                auth = cfg.frontdoor.auth
                read = (name in (cfg.redis_password_env, auth.token_env, auth.metrics_token_env)  # named by the config
                        or f"$({name})" in args  # expanded into the command line by the kubelet
                        or f'"{name}"' in ours  # our code reads it
                        or (name.startswith("RAY_") and f'"{name}"' in ray_sources))  # Ray reads it
                assert read, f"{c['name']}: env {name} is read by nothing"
                checked += 1
    assert checked >= 10
    redis = one(docs, "StatefulSet", "brigade-redis")["spec"]["template"]["spec"]["containers"][0]
    names = {e["name"] for e in redis["env"]}
    assert names == {"REDIS_PASSWORD", "REDISCLI_AUTH"}
    assert "$REDIS_PASSWORD" in redis["args"][0]
    redis_cli = shutil.which("redis-cli")
    if redis_cli is not None:  # installed with redis-server (make system-deps)
        assert b"REDISCLI_AUTH" in Path(redis_cli).read_bytes()


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_auth_comes_from_a_secret_on_every_ray_process(overlay: str) -> None:
    docs = rendered(overlay)
    ray = one(docs, "RayCluster")["spec"]
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert f'"ray=={ray["rayVersion"]}"' in pyproject
    pods = [ray["headGroupSpec"]["template"]["spec"], *[g["template"]["spec"] for g in ray["workerGroupSpecs"]]]
    for pod in pods:
        for c in pod["containers"]:
            env = {e["name"]: e for e in c["env"]}
            assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
            assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "brigade-ray-token",
                                                                          "key": "auth_token"}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_groups_hold_the_configured_workers(overlay: str, tmp_path: Path) -> None:
    docs = rendered(overlay)
    _, cfg = config_of(docs, tmp_path)
    groups = {g["groupName"]: g for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    assert set(groups) == {"prefill", "decode"}
    for role, workers in (("prefill", cfg.num_prefill), ("decode", cfg.decode)):
        group, wanted = groups[role], cfg.placement.resources(role)
        ranks = cfg.parallel.ranks(role)
        (resource, per_rank), = wanted.items()  # one custom resource per role, only this group has it
        other = groups["decode" if role == "prefill" else "prefill"]
        assert resource not in other.get("resources", {})
        per_pod = float(group["resources"][resource])
        limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
        gpus = int(limits.get("nvidia.com/gpu", 0))
        if gpus:  # each rank takes one GPU: the resource counts GPUs
            assert per_pod == gpus * per_rank
        assert per_pod >= ranks * per_rank, f"{role}: a worker's {ranks} ranks must fit on one pod"
        pods_needed = workers  # one worker per pod here; the TP ranks of one worker share a pod
        assert group["replicas"] == group["minReplicas"] == group["maxReplicas"] == pods_needed, role
        if not gpus:
            assert cfg.num_cpus is not None and float(limits["cpu"]) >= cfg.num_cpus / cfg.num_ranks


def test_disruption_budgets_select_the_pods_kuberay_labels() -> None:
    docs = rendered("gpu-prod")
    groups = {g["groupName"] for g in one(docs, "RayCluster")["spec"]["workerGroupSpecs"]}
    budgets = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "PodDisruptionBudget"}
    assert budgets["brigade-head"]["selector"]["matchLabels"]["ray.io/node-type"] == "head"
    assert {b["selector"]["matchLabels"].get("ray.io/group") for b in budgets.values()} - {None} == groups
    redis_labels = one(docs, "StatefulSet", "brigade-redis")["spec"]["template"]["metadata"]["labels"]
    assert budgets["brigade-redis"]["selector"]["matchLabels"].items() <= redis_labels.items()
    policy = one(docs, "NetworkPolicy", "brigade-redis")["spec"]
    assert policy["podSelector"]["matchLabels"].items() <= redis_labels.items()
    assert policy["ingress"][0]["from"][0]["podSelector"]["matchLabels"] == {"ray.io/cluster": "brigade"}
    assert one(docs, "Service", "brigade-redis")["spec"]["type"] == "ClusterIP"


def test_the_images_install_as_the_readme_does() -> None:
    """Both Dockerfiles install with `make venv` and nothing else, the README's set-up."""
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (K8S / name).read_text()
        runs = re.findall(r"^RUN (.+?)(?<!\\)$", text, flags=re.M | re.S)
        installs = [r for r in runs if "make" in r.split() and "venv" in r.split()]
        assert len(installs) == 1, name
        steps = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
        assert "pip" not in steps, f"{name}: installs must go through make venv"
        assert "COPY . ." in text
        for command in ("ray", "brigade", "brigade-client"):  # KubeRay's `ray start`, the head's command
            assert f"/opt/brigade/.venv/bin/{command} " in text and "/usr/local/bin/" in text, (name, command)
    assert "exec brigade serve" in container(head(rendered("cpu-dev")), "brigade")["command"][2]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^serve: venv", makefile, flags=re.M)  # `make serve` is `make venv` and then serve
    assert "make serve" in (ROOT / "README.md").read_text()
    assert "docs/deploy-kubernetes.md" in (ROOT / "README.md").read_text()


# -- the code the deployment needs ---------------------------------------------------------------

def test_redis_password_from_env(monkeypatch) -> None:
    monkeypatch.setenv("PW", "p@ss/word:1")
    assert redis_url_with_password("redis://brigade-redis:6379/0", "PW") == "redis://:p%40ss%2Fword%3A1@brigade-redis:6379/0"
    assert redis_url_with_password("rediss://app@r:6380/1?ssl_ca_certs=/ca.pem", "PW") == \
        "rediss://app:p%40ss%2Fword%3A1@r:6380/1?ssl_ca_certs=/ca.pem"
    assert redis_url_with_password("redis://r:6379/0", None) == "redis://r:6379/0"
    with pytest.raises(ValueError, match="has a password and redis_password_env"):
        redis_url_with_password("redis://:x@r:6379/0", "PW")
    monkeypatch.delenv("PW")
    with pytest.raises(ValueError, match=r"\$PW, which is unset"):
        redis_url_with_password("redis://r:6379/0", "PW")
    with pytest.raises(ValueError, match="redis_password_env needs redis_url"):
        ClusterConfig(redis_password_env="PW")


def test_a_node_host_becomes_each_workers_own_address() -> None:
    cfg = TransferConfig(host="node")
    assert cfg.on_node("10.0.0.9").host == "10.0.0.9" and cfg.host == "node"
    assert TransferConfig(host="127.0.0.1").on_node("10.0.0.9").host == "127.0.0.1"


def test_a_tp_groups_rendezvous_is_on_its_own_node() -> None:
    """decode_worker.group._free_port (run on bundle 0's node) answers that node's address for "node"."""
    import ray

    from decode_worker.group import _free_port
    from kv_transfer.config import NODE_HOST

    host, port = _free_port._function(NODE_HOST)
    assert host == ray.util.get_node_ip_address() and 0 < port < 65536
    assert _free_port._function("127.0.0.1")[0] == "127.0.0.1"


def test_serve_check_prints_the_resolved_config_and_starts_nothing(tmp_path: Path, capsys) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("model: tiny\nhttp_port: 8123\n")
    assert brigade(["serve", "--config", str(path), "--grpc-port", "0", "--check"]) == 0
    out = capsys.readouterr().out
    resolved = yaml.safe_load(out)
    assert (resolved["http_port"], resolved["grpc_port"]) == (8123, 0) and "# config OK" in out
    path.write_text("frontdoor:\n  tls:\n    cert_file: /nonexistent.crt\n    key_file: /nonexistent.key\n")
    with pytest.raises(SystemExit) as exit_:
        brigade(["serve", "--config", str(path), "--check"])
    assert exit_.value.code == 2 and "frontdoor.tls.cert_file /nonexistent.crt" in capsys.readouterr().err


def test_docs_name_what_the_manifests_use() -> None:
    doc = (ROOT / "docs" / "deploy-kubernetes.md").read_text()
    docs = rendered("gpu-prod")
    secrets = {ref["name"] for d in (one(docs, "RayCluster"), one(docs, "StatefulSet")) for ref in _secret_refs(d)}
    assert secrets == {"brigade-redis", "brigade-ray-token", "brigade-api-tokens", "brigade-metrics-token"}
    for secret in secrets | {"brigade-models"}:
        assert secret in doc, secret
    for overlay in OVERLAYS:
        assert f"k8s/overlays/{overlay}" in doc


def _secret_refs(node):
    if isinstance(node, dict):
        if "secretKeyRef" in node:
            yield node["secretKeyRef"]
        for value in node.values():
            yield from _secret_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from _secret_refs(value)


def test_local_ray_provides_the_placement_resources(tmp_path: Path) -> None:
    _, cfg = config_of(rendered("gpu-prod"), tmp_path)  # 2 prefill x 1 rank, 2 decode x 2 ranks
    assert local_resources(cfg) == {"brigade_prefill": 4.0, "brigade_decode": 8.0}
    assert local_resources(ClusterConfig()) == {}


# -- the cpu-dev config, served for real -----------------------------------------------------------

@pytest.mark.slow
def test_the_cpu_dev_config_serves(tmp_path: Path) -> None:
    """The cpu-dev ConfigMap's file, run by `brigade serve` on a local Ray (loopback, instead of
    the pod's address) against a password-protected redis-server: the password from the env
    var the config names, the API token from its env var, each worker's KV address resolved
    from `transfer.host: node`, the workers placed by the `placement` resources."""
    from engine.presets import materialize

    materialize("tiny")
    docs = rendered("cpu-dev")
    _, cfg = config_of(docs, tmp_path)
    password, token = "pw-" + "s3cret" * 4, "k8s-test-token-0123456789"
    with EmbeddedRedis(password=password) as redis:
        text = one(docs, "ConfigMap", "brigade-config")["data"]["cluster.yaml"]
        plain_url = redis.url.replace(f":{password}@", "")
        assert password not in plain_url
        path = tmp_path / "cluster.yaml"
        path.write_text(text.replace(cfg.redis_url, plain_url))
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
               cfg.redis_password_env: password, cfg.frontdoor.auth.token_env: token}
        log = tmp_path / "serve.log"
        argv = [sys.executable, "-m", "cluster.cli", "serve", "--config", str(path), "--host", "127.0.0.1",
                "--http-port", "0", "--grpc-port", "0", "--num-cpus", "2", "--num-blocks", "128"]
        with log.open("w") as err:
            proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        out: list[str] = []
        try:
            while not (out and out[-1].startswith("Brigade serving")):
                ready, _, _ = select.select([proc.stdout], [], [], 120)
                line = proc.stdout.readline() if ready else ""
                assert line, f"no ready line (exit code {proc.poll()}):\n{log.read_text()[-3000:]}"
                out.append(line)
            base = out[-1].split(" at ")[1].split()[0].removesuffix("/v1")
            with urllib.request.urlopen(f"{base}/health", timeout=30) as resp:  # the readiness probe, no token
                assert json.loads(resp.read()) == {"status": "ok"}  # trimmed for a caller without one
            with urllib.request.urlopen(urllib.request.Request(f"{base}/health", headers={
                    "Authorization": f"Bearer {token}"}), timeout=30) as resp:
                health = json.loads(resp.read())
            assert health["prefix_index"] == "ok" and health["workers"] == {"prefill": 1, "decode": 1}
            body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
            request = urllib.request.Request(f"{base}/v1/completions", data=body, headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {token}"})
            with urllib.request.urlopen(request, timeout=60) as resp:  # prefilled, KV moved, decoded
                done = json.loads(resp.read())
            assert done["usage"]["completion_tokens"] == 4
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                code = proc.wait()
            printed = "".join(out) + log.read_text()
            print(printed[-5000:], file=sys.stderr)
        assert code == 0
        assert password not in printed and token not in printed


@pytest.mark.parametrize("overlay", ["cpu-dev", "gpu-prod"])
def test_the_redis_container_command_sets_the_password(overlay: str, tmp_path: Path) -> None:
    """The StatefulSet's own shell line, run with the local redis-server (only its data
    directory and port moved): the password from the env var is required, and the probe's
    `redis-cli ping` answers PONG with REDISCLI_AUTH."""
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        pytest.fail("needs redis-server and redis-cli: run `make system-deps`")
    c = one(rendered(overlay), "StatefulSet", "brigade-redis")["spec"]["template"]["spec"]["containers"][0]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = c["args"][0].replace("dir /data", f"dir {tmp_path}\nport {port}\nbind 127.0.0.1")
    assert script != c["args"][0]
    password = "0123abcd" * 4
    env = {**os.environ, **{e["name"]: password for e in c["env"]}}
    proc = subprocess.Popen([*c["command"], script], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        client = redis_py.Redis(port=port, password=password, socket_connect_timeout=1)
        for _ in range(100):
            try:
                assert client.ping()
                break
            except redis_py.ConnectionError:
                assert proc.poll() is None, f"redis exited with {proc.returncode}"
                time.sleep(0.05)
        else:
            pytest.fail("redis did not answer")
        with pytest.raises(redis_py.AuthenticationError):
            redis_py.Redis(port=port).ping()
        probe = c["readinessProbe"]["exec"]["command"]
        probe = [*probe[:-1], probe[-1].replace("redis-cli", f"redis-cli -p {port}")]
        assert subprocess.run(probe, env=env, timeout=10).returncode == 0
        assert subprocess.run(probe, env={**env, "REDISCLI_AUTH": "wrong"}, timeout=10).returncode != 0
        assert client.config_get("appendonly")["appendonly"] == ("yes" if overlay == "gpu-prod" else "no")
    finally:
        proc.terminate()
        assert proc.wait(10) == 0  # exec: redis-server itself got the SIGTERM and shut down cleanly


def _bytes(quantity: str) -> int:
    units = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40}
    return int(quantity[:-2]) * units[quantity[-2:]] if quantity[-2:] in units else int(quantity)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_object_store_fits_the_shared_memory_volume(overlay: str) -> None:
    ray = one(rendered(overlay), "RayCluster")["spec"]
    for group in [ray["headGroupSpec"], *ray["workerGroupSpecs"]]:
        pod = group["template"]["spec"]
        shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
        ray_c = pod["containers"][0]  # KubeRay's Ray container is the first
        assert {"name": "dshm", "mountPath": "/dev/shm"} in ray_c["volumeMounts"]
        assert int(group["rayStartParams"]["object-store-memory"]) <= _bytes(shm["emptyDir"]["sizeLimit"])
        assert _bytes(shm["emptyDir"]["sizeLimit"]) <= _bytes(ray_c["resources"]["limits"]["memory"])


# -- hardening: non-root, no privileges, read-only roots, no SA token, network policies --

def pods(docs) -> list[tuple[str, dict, dict]]:
    """(name, pod labels, pod spec) of every pod template: the RayCluster's groups and Redis."""
    ray = one(docs, "RayCluster")
    labels = {"ray.io/cluster": ray["metadata"]["name"]}
    out = [("head", {**labels, "ray.io/node-type": "head"}, ray["spec"]["headGroupSpec"]["template"]["spec"])]
    out += [(g["groupName"], {**labels, "ray.io/node-type": "worker"}, g["template"]["spec"])
            for g in ray["spec"]["workerGroupSpecs"]]
    redis = one(docs, "StatefulSet", "brigade-redis")["spec"]["template"]
    out.append(("redis", redis["metadata"]["labels"], redis["spec"]))
    return out


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_pod_runs_unprivileged(overlay: str) -> None:
    for name, _, spec in pods(rendered(overlay)):
        assert spec["automountServiceAccountToken"] is False, name
        pod = spec["securityContext"]
        assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0 and pod["runAsGroup"] != 0, name
        assert pod["seccompProfile"] == {"type": "RuntimeDefault"}, name
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False, (name, c["name"])
            assert sc["capabilities"] == {"drop": ["ALL"]}, (name, c["name"])
            assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
            assert sc.get("privileged") is not True and sc.get("runAsUser", 1) != 0, (name, c["name"])


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_what_the_processes_write_is_on_an_empty_dir(overlay: str) -> None:
    docs = rendered(overlay)
    for name, _, spec in pods(docs):
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        for c in spec["containers"]:
            mounts = {m["mountPath"]: m["name"] for m in c.get("volumeMounts", [])}
            if name == "redis":
                assert "/data" in mounts, c["name"]  # its one write path (an emptyDir, or gpu-prod's claim)
                continue
            for path in ("/tmp", "/dev/shm"):  # Ray's session files and HOME (/tmp), its object store
                if path == "/dev/shm" and c["name"] == "brigade":
                    continue  # the driver keeps no object store
                assert path in mounts and "emptyDir" in volumes[mounts[path]], (name, c["name"], path)


def test_the_images_run_as_a_non_root_user_with_home_on_tmp() -> None:
    for name in ("Dockerfile", "Dockerfile.cuda"):
        text = (K8S / name).read_text()
        assert re.search(r"^RUN .*useradd --uid 1000 ", text, flags=re.M), name
        user = re.findall(r"^USER (\S+)", text, flags=re.M)
        assert user and user[-1].split(":")[0] not in ("0", "root"), name
        assert text.rindex("USER ") > text.rindex("RUN make venv"), name  # installed as root, run as the user
        assert "HOME=/tmp" in text, name


def _selects(policy: dict, labels: dict) -> bool:
    want = policy["spec"]["podSelector"].get("matchLabels", {})
    return all(labels.get(k) == v for k, v in want.items())


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_a_network_policy_selects_every_pod(overlay: str) -> None:
    docs = rendered(overlay)
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    for name, labels, _ in pods(docs):
        mine = [p for p in policies if _selects(p, labels)]
        assert mine and all("Ingress" in p["spec"]["policyTypes"] for p in mine), name


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_ports_only_from_the_ray_cluster_and_the_doors_only_from_clients(overlay: str) -> None:
    docs = rendered(overlay)
    policies = {d["metadata"]["name"]: d for d in docs if d["kind"] == "NetworkPolicy"}
    cluster = {"ray.io/cluster": "brigade"}
    ray = policies["brigade-ray"]["spec"]
    assert ray["podSelector"]["matchLabels"] == cluster
    assert ray["ingress"] == [{"from": [{"podSelector": {"matchLabels": cluster}}]}]  # all ports, own pods only
    doors = policies["brigade-doors"]["spec"]
    assert doors["podSelector"]["matchLabels"] == {**cluster, "ray.io/node-type": "head"}
    for rule in doors["ingress"]:
        assert sorted(p["port"] for p in rule["ports"]) == [8000, 50051]
        assert all("podSelector" in peer or "namespaceSelector" in peer for peer in rule["from"])  # never open
    # Every other policy on a Ray pod opens named ports only (no rule without `ports` but brigade-ray's).
    for name, policy in policies.items():
        if name in ("brigade-ray",):
            continue
        for rule in policy["spec"]["ingress"]:
            assert rule.get("ports"), name
    assert ("brigade-metrics" in policies) == (overlay == "gpu-prod-monitoring")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_prometheus_gets_a_scrape_only_token(overlay: str, tmp_path) -> None:
    docs = rendered(overlay)
    brigade = next(c for c in head(docs)["containers"] if c["name"] == "brigade")
    env = {e["name"]: e for e in brigade["env"]}
    ref = env["BRIGADE_METRICS_TOKENS"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "brigade-metrics-token", "key": "token", "optional": True}
    cfg = yaml.safe_load(one(docs, "ConfigMap", "brigade-config")["data"]["cluster.yaml"])
    auth = AuthConfig(**cfg["frontdoor"]["auth"])
    assert auth.metrics_token_env == "BRIGADE_METRICS_TOKENS" and auth.token_env == "BRIGADE_API_TOKENS"
    if overlay == "gpu-prod-monitoring":
        monitor = one(docs, "ServiceMonitor")["spec"]["endpoints"][0]
        assert monitor["authorization"]["credentials"] == {"name": "brigade-metrics-token", "key": "token"}


# -- extra fronts: k8s/overlays/cpu-dev-fronts --------------------------------------------

FRONTS = "cpu-dev-fronts"


def front_pod(docs) -> dict:
    return one(docs, "Deployment", "brigade-front")["spec"]["template"]


def test_the_fronts_overlay_validates_and_adds_only_the_fronts() -> None:
    docs = rendered(FRONTS)
    for doc in docs:
        validate(doc)
    names = lambda ds: {(d["kind"], d["metadata"]["name"]) for d in ds}  # noqa: E731
    assert names(docs) - names(rendered("cpu-dev")) == {
        ("Deployment", "brigade-front"), ("PodDisruptionBudget", "brigade-front"),
        ("NetworkPolicy", "brigade-front-ray"), ("NetworkPolicy", "brigade-front-doors")}
    assert one(docs, "RayCluster")["spec"]["workerGroupSpecs"] == one(rendered("cpu-dev"), "RayCluster")["spec"][
        "workerGroupSpecs"]  # the workers are the owner's, unchanged


def test_the_service_sends_to_the_head_and_every_front_on_the_same_doors() -> None:
    docs = rendered(FRONTS)
    selector = one(docs, "Service", "brigade")["spec"]["selector"]
    head_labels = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["metadata"]["labels"]
    front = front_pod(docs)
    assert selector.items() <= head_labels.items() and selector.items() <= front["metadata"]["labels"].items()
    head_ports = container(head(docs), "brigade")["ports"]
    assert container(front["spec"], "brigade")["ports"] == head_ports
    # Readiness on /health takes a draining front (or one without live workers) out of the Service.
    assert container(front["spec"], "brigade")["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert one(docs, "PodDisruptionBudget", "brigade-front")["spec"]["maxUnavailable"] == 1


def test_a_front_pod_is_a_ray_node_without_cpus_with_ray_auth_from_the_secret() -> None:
    spec = front_pod(rendered(FRONTS))["spec"]
    ray_node = container(spec, "ray-node")
    script = ray_node["command"][2]
    assert script.startswith("exec ray start --block --address brigade-head-svc:6379 ")
    assert '--node-ip-address "$POD_IP"' in script and "--num-cpus 0" in script  # no worker lands here
    for c in spec["containers"]:
        env = {e["name"]: e for e in c["env"]}
        assert env["RAY_AUTH_MODE"]["value"] == "token", c["name"]
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "brigade-ray-token", "key": "auth_token"}


def test_a_front_pod_passes_serve_check_as_a_front(tmp_path: Path, monkeypatch, capsys) -> None:
    docs = rendered(FRONTS)
    path, cfg = config_of(docs, tmp_path)
    c = container(front_pod(docs)["spec"], "brigade")
    shell, flag, script, _name = c["command"]
    assert (shell, flag) == ("sh", "-c") and script.rstrip().endswith('exec brigade serve "$@"')
    assert '--address "brigade-head-svc:6379"' in script
    args = ["serve", *(a.replace("$(POD_IP)", POD_IP) for a in c["args"])]
    assert "--front-only" in args and args[args.index("--ray-address") + 1] == "brigade-head-svc:6379"
    args[args.index("--config") + 1] = str(path)
    for name in (cfg.redis_password_env, cfg.frontdoor.auth.token_env):
        monkeypatch.setenv(name, "tenant-a a-secret-value-0123456789")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert brigade([*args, "--check"]) == 0
    out = capsys.readouterr().out
    assert "role: front" in out and f"host: {POD_IP}" in out and cfg.redis_url in out
    env = {e["name"] for e in c["env"]}
    assert {cfg.redis_password_env, cfg.frontdoor.auth.token_env, "POD_IP"} <= env


def test_a_front_pod_runs_unprivileged_and_writes_only_to_empty_dirs() -> None:
    template = front_pod(rendered(FRONTS))
    spec = template["spec"]
    assert spec["automountServiceAccountToken"] is False
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] != 0 and pod["seccompProfile"] == {"type": "RuntimeDefault"}
    volumes = {v["name"]: v for v in spec["volumes"]}
    for c in spec["containers"]:
        sc = c["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}
        assert sc["readOnlyRootFilesystem"] is True
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        for path in ("/tmp", *(["/dev/shm"] if c["name"] == "ray-node" else [])):
            assert "emptyDir" in volumes[mounts[path]], (c["name"], path)


def test_fronts_reach_the_ray_cluster_and_redis_and_only_clients_reach_their_doors() -> None:
    docs = rendered(FRONTS)
    policies = {d["metadata"]["name"]: d["spec"] for d in docs if d["kind"] == "NetworkPolicy"}
    fronts = {"app.kubernetes.io/name": "brigade-front"}
    labels = front_pod(docs)["metadata"]["labels"]
    mine = [n for n, p in policies.items() if _selects({"spec": p}, labels)]
    assert sorted(mine) == ["brigade-front-doors", "brigade-front-ray"]
    for name in ("brigade-ray", "brigade-redis"):  # the RayCluster's pods and Redis let the fronts in
        assert {"podSelector": {"matchLabels": fronts}} in policies[name]["ingress"][0]["from"], name
    assert policies["brigade-front-ray"]["ingress"] == [{"from": [
        {"podSelector": {"matchLabels": {"ray.io/cluster": "brigade"}}}, {"podSelector": {"matchLabels": fronts}}]}]
    doors = policies["brigade-front-doors"]["ingress"]
    assert [sorted(p["port"] for p in rule["ports"]) for rule in doors] == [[8000, 50051]]
    clients = {"matchLabels": {"brigade.io/client": "true"}}
    assert doors[0]["from"] == [{"namespaceSelector": {}, "podSelector": clients}]

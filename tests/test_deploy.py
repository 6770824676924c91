"""deploy/ validated offline: YAML parses, kustomizations render, every object passes the
Kubernetes JSON schema (kubernetes-validate, strict), and the manifests keep the promises
the sidecar relies on (probes, drain bound, Redis isolation, secrets, Settings names).

The kustomizations are rendered by the small pure-Python renderer below, which supports
exactly the kustomize features deploy/ uses and refuses any other field. Where a
``kubectl`` binary exists, a test checks the renderer's output equals ``kubectl
kustomize``'s, object for object, generated names included.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import hashlib
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from nccl_back.config import ENV_PREFIX, SECRET_FILE_ENV, Settings

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
OVERLAYS = {
    "example": DEPLOY / "overlays" / "example",
    "shared-gpu": DEPLOY / "overlays" / "shared-gpu",
    "pre-1.29": DEPLOY / "overlays" / "pre-1.29",
}
#: Overlays whose sidecar is a native one (an init container with restartPolicy Always).
NATIVE = {"example", "shared-gpu"}
# Oldest and newest Kubernetes each kustomization is validated against. Native sidecars
# are on by default from 1.29 (beta; GA in 1.33); the pre-1.29 overlay must also pass the
# older schemas, where a container has no restartPolicy. resource.k8s.io/v1 (Dynamic
# Resource Allocation, used by shared-gpu) is GA from 1.34.
K8S_VERSIONS = {
    "base": ("1.29.0", kubernetes_validate.latest_version()),
    "example": ("1.29.0", kubernetes_validate.latest_version()),
    "shared-gpu": ("1.34.0", kubernetes_validate.latest_version()),
    "pre-1.29": ("1.25.0", kubernetes_validate.latest_version()),
}
#: Seconds the native-sidecar pods leave the inference container to exit before the
#: sidecar's own preStop starts (see the grace-period comment in base/worker.yaml).
INFERENCE_STOP_S = 30
KUSTOMIZATIONS = {"base": DEPLOY / "base", **OVERLAYS}
CLUSTER_SCOPED = {"Namespace"}
WORKER = {"app.kubernetes.io/name": "nccl-back", "app.kubernetes.io/component": "worker"}

pytestmark = pytest.mark.timeout(60)

Obj = dict[str, Any]


# --------------------------------------------------------------------------- renderer


def _kustomization(directory: Path) -> Obj:
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    supported = {
        "apiVersion", "kind", "resources", "namespace", "images",
        "configMapGenerator", "secretGenerator", "patches",
    }
    unknown = set(k) - supported
    if unknown:
        raise NotImplementedError(f"{directory}: renderer does not support {sorted(unknown)}")
    return k


def _literals(gen: Obj) -> dict[str, str]:
    unknown = set(gen) - {"name", "literals", "behavior"}
    if unknown:
        raise NotImplementedError(f"generator {gen['name']}: unsupported {sorted(unknown)}")
    return dict(str(lit).split("=", 1) for lit in gen.get("literals", []))


def _generate(objs: list[Obj], generated: set[tuple[str, str]], gen: Obj, kind: str) -> None:
    data = _literals(gen)
    if kind == "Secret":
        data = {k: base64.b64encode(v.encode()).decode() for k, v in data.items()}
    key = (kind, gen["name"])
    if gen.get("behavior", "create") == "merge":
        target = next(o for o in objs if (o["kind"], o["metadata"]["name"]) == key)
        target["data"].update(data)
        return
    obj: Obj = {"apiVersion": "v1", "kind": kind, "metadata": {"name": gen["name"]}, "data": data}
    if kind == "Secret":
        obj["type"] = "Opaque"
    objs.append(obj)
    generated.add(key)


def _pod_specs(obj: Obj) -> Iterator[Obj]:
    if obj["kind"] in ("Deployment", "StatefulSet", "DaemonSet", "Job"):
        yield obj["spec"]["template"]["spec"]


def _containers(obj: Obj) -> Iterator[Obj]:
    for spec in _pod_specs(obj):
        yield from spec.get("initContainers", [])
        yield from spec["containers"]


def _split_image(image: str) -> tuple[str, str | None]:
    name, sep, tag = image.rpartition(":")
    if sep and "/" not in tag:
        return name, tag
    return image, None


def _set_images(objs: list[Obj], images: list[Obj]) -> None:
    for obj in objs:
        for c in _containers(obj):
            name, tag = _split_image(c["image"])
            for rule in images:
                if rule["name"] == name:
                    new_name = rule.get("newName", name)
                    new_tag = rule.get("newTag", tag)
                    c["image"] = f"{new_name}:{new_tag}" if new_tag else new_name


def _pointer(path: str) -> list[str]:
    return [p.replace("~1", "/").replace("~0", "~") for p in path.lstrip("/").split("/")]


def _json_patch(obj: Obj, ops: list[Obj]) -> None:
    """RFC 6902 test/add/remove/replace/move (the ops deploy/ uses)."""
    for op in ops:
        if op["op"] == "move":
            *parents, last = _pointer(op["from"])
            node: Any = obj
            for part in parents:
                node = node[int(part)] if isinstance(node, list) else node[part]
            value = node.pop(int(last) if isinstance(node, list) else last)
            _json_patch(obj, [{"op": "add", "path": op["path"], "value": value}])
            continue
        *parents, last = _pointer(op["path"])
        node = obj
        for part in parents:
            node = node[int(part)] if isinstance(node, list) else node[part]
        index: Any = int(last) if isinstance(node, list) and last != "-" else last
        if op["op"] == "test":
            if node[index] != op["value"]:
                raise ValueError(f"patch test failed at {op['path']}: {node[index]!r}")
        elif op["op"] == "remove":
            del node[index]
        elif op["op"] in ("add", "replace"):
            if isinstance(node, list) and op["op"] == "add":
                node.insert(len(node) if index == "-" else index, copy.deepcopy(op["value"]))
            else:
                if op["op"] == "replace" and index not in node:
                    raise KeyError(op["path"])
                node[index] = copy.deepcopy(op["value"])
        else:
            raise NotImplementedError(f"JSON patch op {op['op']!r}")


def _patch(objs: list[Obj], patches: list[Obj]) -> None:
    for p in patches:
        target = p["target"]
        if set(p) != {"target", "patch"} or set(target) - {"group", "version", "kind", "name"}:
            raise NotImplementedError(f"patch form {sorted(p)} / target {sorted(target)}")
        matches = [
            o for o in objs
            if o["kind"] == target["kind"]
            and o["metadata"]["name"] == target["name"]
            and o["apiVersion"] == "/".join(filter(None, [target.get("group"), target["version"]]))
        ]
        if len(matches) != 1:
            raise ValueError(f"patch target {target} matched {len(matches)} objects")
        _json_patch(matches[0], yaml.safe_load(p["patch"]))


def _render(directory: Path, generated: set[tuple[str, str]]) -> list[Obj]:
    k = _kustomization(directory)
    objs: list[Obj] = []
    for res in k.get("resources", []):
        path = (directory / res).resolve()
        if path.is_dir():
            objs += _render(path, generated)
        else:
            objs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    for gen in k.get("configMapGenerator", []):
        _generate(objs, generated, gen, "ConfigMap")
    for gen in k.get("secretGenerator", []):
        _generate(objs, generated, gen, "Secret")
    if "namespace" in k:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    _set_images(objs, k.get("images", []))
    _patch(objs, k.get("patches", []))
    return objs


def _name_hash(obj: Obj) -> str:
    """kustomize's generated-name suffix: sha256 of the JSON of kind and data (and type),
    Go-style (sorted keys, HTML-escaped), first 10 hex digits with 0/1/3/a/e remapped."""
    fields = {"data": obj["data"], "kind": obj["kind"], "name": ""}
    if obj["kind"] == "Secret":
        fields["type"] = obj["type"]
    encoded = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, esc in (("&", "\\u0026"), ("<", "\\u003c"), (">", "\\u003e")):
        encoded = encoded.replace(char, esc)
    digest = hashlib.sha256(encoded.encode()).hexdigest()[:10]
    return digest.translate(str.maketrans("013ae", "ghkmt"))


def _rename_refs(spec: Obj, renames: dict[tuple[str, str], str]) -> None:
    def fix(ref: Obj | None, kind: str) -> None:
        if ref is not None and (kind, ref.get("name")) in renames:
            ref["name"] = renames[(kind, ref["name"])]

    for c in [*spec.get("initContainers", []), *spec["containers"]]:
        for source in c.get("envFrom", []):
            fix(source.get("configMapRef"), "ConfigMap")
            fix(source.get("secretRef"), "Secret")
        for env in c.get("env", []):
            value_from = env.get("valueFrom", {})
            fix(value_from.get("configMapKeyRef"), "ConfigMap")
            fix(value_from.get("secretKeyRef"), "Secret")
    for vol in spec.get("volumes", []):
        fix(vol.get("configMap"), "ConfigMap")
        if "secret" in vol and ("Secret", vol["secret"].get("secretName")) in renames:
            vol["secret"]["secretName"] = renames[("Secret", vol["secret"]["secretName"])]


def render(directory: Path) -> list[Obj]:
    """The objects ``kubectl kustomize directory`` would print (same names, same content)."""
    generated: set[tuple[str, str]] = set()
    objs = _render(directory, generated)
    renames: dict[tuple[str, str], str] = {}
    for obj in objs:
        key = (obj["kind"], obj["metadata"]["name"])
        if key in generated:
            obj["metadata"]["name"] = renames[key] = f"{key[1]}-{_name_hash(obj)}"
    for obj in objs:
        for spec in _pod_specs(obj):
            _rename_refs(spec, renames)
    return objs


# --------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[Obj]]:
    return {name: render(path) for name, path in KUSTOMIZATIONS.items()}


def one(objs: list[Obj], kind: str, name_prefix: str) -> Obj:
    found = [o for o in objs if o["kind"] == kind and o["metadata"]["name"].startswith(name_prefix)]
    assert len(found) == 1, f"expected one {kind} {name_prefix}*, found {len(found)}"
    return found[0]


def container(objs: list[Obj], deployment: str, name: str) -> Obj:
    """A container of the deployment's pod, regular or init (a native sidecar)."""
    spec = one(objs, "Deployment", deployment)["spec"]["template"]["spec"]
    return next(c for c in [*spec.get("initContainers", []), *spec["containers"]] if c["name"] == name)


def flag(args: list[str], name: str) -> str:
    """The value after ``name`` in an argv list."""
    assert name in args, f"{name} missing from {args}"
    return args[args.index(name) + 1]


def config_data(objs: list[Obj]) -> dict[str, str]:
    return dict(one(objs, "ConfigMap", "nccl-back-config")["data"])


def selects(selector: Obj, labels: dict[str, str]) -> bool:
    """Does a LabelSelector (matchLabels only, as deploy/ uses) select these labels?"""
    if set(selector) - {"matchLabels"}:
        raise NotImplementedError(f"selector fields {sorted(selector)}")
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def pod_labels(obj: Obj) -> dict[str, str]:
    return dict(obj["spec"]["template"]["metadata"]["labels"])


# --------------------------------------------------------------------------- tests


def test_every_yaml_file_parses() -> None:
    """Every YAML file under deploy/ parses and each document names its apiVersion and kind."""
    files = sorted(DEPLOY.rglob("*.yaml"))
    assert len(files) >= 6
    for path in files:
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert docs, f"{path} is empty"
        for doc in docs:
            assert {"apiVersion", "kind"} <= set(doc), f"{path}: a document lacks apiVersion/kind"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl on PATH to compare with")
@pytest.mark.parametrize("name", sorted(KUSTOMIZATIONS))
def test_renderer_matches_kubectl_kustomize(name: str, rendered: dict[str, list[Obj]]) -> None:
    """The pure-Python render equals `kubectl kustomize`'s, object for object."""
    out = subprocess.run(
        ["kubectl", "kustomize", str(KUSTOMIZATIONS[name])],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout
    theirs = [d for d in yaml.safe_load_all(out) if d]

    def key(o: Obj) -> tuple[str, str]:
        return o["kind"], o["metadata"]["name"]

    assert sorted(rendered[name], key=key) == sorted(theirs, key=key)


@pytest.mark.parametrize(
    ("name", "version"), [(n, v) for n, vs in K8S_VERSIONS.items() for v in vs]
)
def test_objects_validate_against_kubernetes_schemas(
    name: str, version: str, rendered: dict[str, list[Obj]]
) -> None:
    """Every rendered object passes the strict Kubernetes JSON schema of that version."""
    objs = rendered[name]
    assert objs
    for obj in objs:
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            path = ".".join(str(p) for p in e.path)
            pytest.fail(f"{name}: {obj['kind']}/{obj['metadata']['name']} at {path}: {e.message}")


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_references_resolve(name: str, rendered: dict[str, list[Obj]]) -> None:
    """Every ConfigMap and Secret a pod references exists in the same rendered namespace."""
    objs = rendered[name]
    present = {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")) for o in objs}
    for obj in objs:
        ns = obj["metadata"].get("namespace")
        for c in _containers(obj):
            for src in c.get("envFrom", []):
                assert ("ConfigMap", src["configMapRef"]["name"], ns) in present
            for env in c.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref:
                    secret = one(objs, "Secret", ref["name"])
                    assert secret["metadata"]["name"] == ref["name"]
                    assert ref["key"] in secret["data"]


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_probes_point_at_the_sidecar_health_port(name: str, rendered: dict[str, list[Obj]]) -> None:
    """Readiness is /readyz and liveness /healthz on the port the sidecar serves health on."""
    sidecar = container(rendered[name], "nccl-back-worker", "nccl-back")
    health_port = int(flag(sidecar["args"], "--health-port"))
    assert flag(sidecar["args"], "--health-host") == "0.0.0.0"  # the kubelet probes the pod IP
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = sidecar[probe]["httpGet"]
        assert get["path"] == path
        assert ports.get(get["port"], get["port"]) == health_port


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_grace_period_covers_the_drain_bound(name: str, rendered: dict[str, list[Obj]]) -> None:
    """preStop drains for at least the drain bound and the grace period outlasts preStop."""
    objs = rendered[name]
    cfg = config_data(objs)
    drain_bound = (
        float(cfg["NCCL_BACK_HANDSHAKE_TIMEOUT"]) / 10  # the sender's handshake
        + float(cfg["NCCL_BACK_TRANSFER_TIMEOUT"])
        + float(cfg["NCCL_BACK_REDIS_TIMEOUT"])
    )
    spec = one(objs, "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    sidecar = container(objs, "nccl-back-worker", "nccl-back")
    hook = sidecar["lifecycle"]["preStop"]["exec"]["command"]
    assert hook[:2] == ["nccl-back", "drain"]
    assert flag(hook, "--port") == flag(sidecar["args"], "--health-port")
    assert flag(hook, "--token-file") == flag(sidecar["args"], "--drain-token-file")
    pre_stop_timeout = float(flag(hook, "--timeout"))
    assert pre_stop_timeout >= drain_bound
    # A native sidecar is stopped only after the inference container has exited.
    first = INFERENCE_STOP_S if name in NATIVE else 0
    assert spec["terminationGracePeriodSeconds"] >= first + pre_stop_timeout + 5


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_network_policy_admits_only_workers_to_redis(name: str, rendered: dict[str, list[Obj]]) -> None:
    """The NetworkPolicy selects the Redis pods and admits only worker pods, on 6379 only."""
    objs = rendered[name]
    policy = one(objs, "NetworkPolicy", "nccl-back-redis")["spec"]
    redis = one(objs, "Deployment", "nccl-back-redis")
    worker = one(objs, "Deployment", "nccl-back-worker")
    assert selects(policy["podSelector"], pod_labels(redis))
    assert not selects(policy["podSelector"], pod_labels(worker))
    service = one(objs, "Service", "nccl-back-redis")["spec"]
    assert selects({"matchLabels": service["selector"]}, pod_labels(redis))
    assert policy["policyTypes"] == ["Ingress"]
    assert policy["ingress"], "an empty ingress list would deny workers too"
    for rule in policy["ingress"]:
        assert rule["ports"] == [{"protocol": "TCP", "port": 6379}]
        assert rule["from"], "a rule without `from` admits every source"
        for peer in rule["from"]:
            assert set(peer) == {"podSelector"}, f"non-pod source admitted: {peer}"
            assert peer["podSelector"]["matchLabels"] == WORKER
            assert selects(peer["podSelector"], pod_labels(worker))
            assert not selects(peer["podSelector"], pod_labels(redis))


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_redis_password_comes_from_a_secret(name: str, rendered: dict[str, list[Obj]]) -> None:
    """Redis and the sidecar take the password from the Secret; no manifest holds it."""
    objs = rendered[name]
    secret = one(objs, "Secret", "nccl-back-redis")
    password = base64.b64decode(secret["data"]["password"]).decode()
    for deployment, cname in (("nccl-back-redis", "redis"), ("nccl-back-worker", "nccl-back")):
        c = container(objs, deployment, cname)
        names = [e["name"] for e in c["env"]]
        ref = c["env"][names.index("REDIS_PASSWORD")]["valueFrom"]["secretKeyRef"]
        assert ref == {"name": secret["metadata"]["name"], "key": "password"}
    redis = container(objs, "nccl-back-redis", "redis")
    assert flag(redis["args"], "--requirepass") == "$(REDIS_PASSWORD)"
    sidecar = container(objs, "nccl-back-worker", "nccl-back")
    names = [e["name"] for e in sidecar["env"]]
    url = sidecar["env"][names.index("NCCL_BACK_REDIS_URL")]["value"]
    assert "$(REDIS_PASSWORD)@" in url
    # $(VAR) expands only variables defined earlier in the list.
    assert names.index("REDIS_PASSWORD") < names.index("NCCL_BACK_REDIS_URL")
    for obj in objs:
        if obj["kind"] != "Secret":
            assert password not in json.dumps(obj), f"{obj['kind']} holds the password"


def sidecar_environment(objs: list[Obj]) -> dict[str, str]:
    """The sidecar's environment as the kubelet builds it: envFrom, then env with $(VAR)."""
    sidecar = container(objs, "nccl-back-worker", "nccl-back")
    env: dict[str, str] = {}
    for src in sidecar["envFrom"]:
        env.update(one(objs, "ConfigMap", src["configMapRef"]["name"])["data"])
    for e in sidecar["env"]:
        if "value" in e:
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "secretKeyRef" in e["valueFrom"]:
            ref = e["valueFrom"]["secretKeyRef"]
            secret = one(objs, "Secret", ref["name"])
            env[e["name"]] = base64.b64decode(secret["data"][ref["key"]]).decode()
        else:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
            env[e["name"]] = "10.1.2.3"
    return env


def mounted_secret(objs: list[Obj], path: str) -> str:
    """The content of a file the sidecar reads from a mounted Secret volume."""
    sidecar = container(objs, "nccl-back-worker", "nccl-back")
    spec = one(objs, "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in sidecar["volumeMounts"]:
        if path.startswith(mount["mountPath"] + "/"):
            source = volumes[mount["name"]]["secret"]
            secret = one(objs, "Secret", source["secretName"])
            key = path.removeprefix(mount["mountPath"] + "/")
            return base64.b64decode(secret["data"][key]).decode()
    raise AssertionError(f"{path} is on no mounted Secret")


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_fleet_secret_is_required_and_mounted_privately(
    name: str, rendered: dict[str, list[Obj]]
) -> None:
    """The sidecar reads the fleet secret from a read-only 0400 Secret volume, not the env."""
    objs = rendered[name]
    sidecar = container(objs, "nccl-back-worker", "nccl-back")
    env = {e["name"]: e for e in sidecar["env"]}
    assert "NCCL_BACK_SECRET" not in env, "the secret must not sit in an env var"
    path = env["NCCL_BACK_SECRET_FILE"]["value"]
    secret = mounted_secret(objs, path)
    assert len(secret.encode()) >= 16
    assert secret != base64.b64decode(one(objs, "Secret", "nccl-back-redis")["data"]["password"]).decode()
    spec = one(objs, "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    volume = next(v for v in spec["volumes"] if "secret" in v and path.startswith("/etc/nccl-back"))
    assert volume["secret"]["defaultMode"] == 0o400
    mount = next(m for m in sidecar["volumeMounts"] if m["name"] == volume["name"])
    assert mount["readOnly"] is True
    inference = container(objs, "nccl-back-worker", "inference")
    assert all(m["name"] != volume["name"] for m in inference["volumeMounts"])


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_network_policy_admits_only_workers_to_transfer_ports(
    name: str, rendered: dict[str, list[Obj]]
) -> None:
    """Worker pods admit other workers on every TCP port (gloo's and NCCL's are ephemeral),
    anyone else on health/inference only."""
    objs = rendered[name]
    policy = one(objs, "NetworkPolicy", "nccl-back-worker")["spec"]
    worker = one(objs, "Deployment", "nccl-back-worker")
    redis = one(objs, "Deployment", "nccl-back-redis")
    assert selects(policy["podSelector"], pod_labels(worker))
    assert policy["policyTypes"] == ["Ingress"]
    sidecar = container(objs, "nccl-back-worker", "nccl-back")
    inference = container(objs, "nccl-back-worker", "inference")
    open_ports = {int(flag(sidecar["args"], "--health-port"))} | {
        p["containerPort"] for p in inference["ports"]
    }
    for rule in policy["ingress"]:
        if "from" in rule:
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}, f"non-pod source admitted: {peer}"
                assert selects(peer["podSelector"], pod_labels(worker))
                assert not selects(peer["podSelector"], pod_labels(redis))
            assert all("port" not in p and p.get("protocol", "TCP") == "TCP"
                       for p in rule.get("ports", [])), "worker to worker: every TCP port"
        else:
            ports = {p["port"] for p in rule["ports"]}
            assert ports == open_ports, "only health and inference ports are open to all"
            assert all("endPort" not in p for p in rule["ports"])


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_nccl_back_variables_are_settings_fields(
    name: str, rendered: dict[str, list[Obj]], tmp_path: Path
) -> None:
    """Every NCCL_BACK_* variable names a Settings field, and Settings accepts their values."""
    objs = rendered[name]
    fields = {ENV_PREFIX + f.name.upper() for f in dataclasses.fields(Settings)} | {SECRET_FILE_ENV}
    mentioned = set(re.findall(r"\bNCCL_BACK_[A-Z0-9_]+\b", json.dumps(objs)))
    assert mentioned, "the manifests set no NCCL_BACK_ variable"
    assert mentioned <= fields, f"not Settings fields: {sorted(mentioned - fields)}"
    env = sidecar_environment(objs)
    secret_file = tmp_path / "secret"
    secret_file.write_text(mounted_secret(objs, env.pop("NCCL_BACK_SECRET_FILE")))
    settings = Settings.from_env({**env, "NCCL_BACK_SECRET_FILE": str(secret_file)})
    assert settings.secret is not None
    assert settings.transport == "nccl"
    assert settings.advertise_host == "10.1.2.3"
    assert settings.redis_url.startswith("redis://:") and settings.redis_url.endswith(":6379/0")
    assert env["NCCL_BACK_ADVERTISE_HOST"] == "10.1.2.3"


@pytest.mark.parametrize("name", sorted(OVERLAYS))
def test_worker_pod_shape(name: str, rendered: dict[str, list[Obj]]) -> None:
    """Two containers share the socket and /dev/shm volumes; ports declared; no hostIPC."""
    objs = rendered[name]
    spec = one(objs, "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    if name in NATIVE:
        assert [c["name"] for c in spec["containers"]] == ["inference"]
        assert [c["name"] for c in spec["initContainers"]] == ["nccl-back"]
    else:
        assert [c["name"] for c in spec["containers"]] == ["inference", "nccl-back"]
        assert "initContainers" not in spec
    assert not spec.get("hostIPC") and not spec.get("hostNetwork") and not spec.get("hostPID")
    volumes = {v["name"]: v for v in spec["volumes"]}
    assert volumes["dshm"]["emptyDir"]["medium"] == "Memory"
    inference = container(objs, "nccl-back-worker", "inference")
    sidecar = container(objs, "nccl-back-worker", "nccl-back")
    socket = flag(sidecar["args"], "--socket")
    inference_env = {e["name"]: e.get("value") for e in inference["env"]}
    assert inference_env["HANDOFF_SOCKET"] == socket
    # The socket sits in a directory of its own inside the shared volume: an emptyDir
    # is writable by all, and attach() refuses such a directory.
    assert flag(sidecar["args"], "--drain-token-file").startswith(str(Path(socket).parent) + "/")
    for c in (inference, sidecar):
        mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
        assert mounts["/dev/shm"] == "dshm"
        assert mounts[str(Path(socket).parent.parent)] == "handoff"
    assert sidecar["command"] == ["nccl-back", "serve"]
    assert flag(sidecar["args"], "--model") == "$(MODEL_URI)"
    assert flag(sidecar["args"], "--device") == "cuda:0"
    # The rendezvous goes through Redis: no rendezvous port to pass, declare or open.
    assert not {"--rendezvous-port", "--bind-host"} & set(sidecar["args"])
    ports = {p["name"]: p["containerPort"] for p in sidecar["ports"]}
    assert ports == {"health": int(flag(sidecar["args"], "--health-port"))}
    for c in (inference, sidecar):
        name_, tag = _split_image(c["image"])
        assert tag and "/" in name_, f"{c['name']}: image {c['image']} not set by the overlay"


@pytest.mark.parametrize("name", sorted(NATIVE))
def test_sidecar_is_native(name: str, rendered: dict[str, list[Obj]]) -> None:
    """The sidecar is the pod's first init container with restartPolicy Always (started
    before inference, stopped after it) and a startup probe on /healthz gates inference."""
    objs = rendered[name]
    spec = one(objs, "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    sidecar = spec["initContainers"][0]
    assert sidecar["name"] == "nccl-back" and sidecar["restartPolicy"] == "Always"
    assert sidecar["startupProbe"]["httpGet"] == {"path": "/healthz", "port": "health"}
    for c in spec["containers"]:
        assert "restartPolicy" not in c


def test_pre_1_29_overlay_keeps_the_ordinary_sidecar(rendered: dict[str, list[Obj]]) -> None:
    """pre-1.29 is the example with the same sidecar as an ordinary second container."""
    native = container(rendered["example"], "nccl-back-worker", "nccl-back")
    old = container(rendered["pre-1.29"], "nccl-back-worker", "nccl-back")
    assert "restartPolicy" not in old
    assert old == {k: v for k, v in native.items() if k != "restartPolicy"}
    spec = one(rendered["pre-1.29"], "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    example = one(rendered["example"], "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    assert spec["containers"][0] == example["containers"][0]


def test_renderer_supports_move(tmp_path: Path) -> None:
    """The renderer's JSON patch `move` takes an item out of one list into another."""
    obj: Obj = {"a": [{"n": 1}], "b": [{"n": 0}]}
    _json_patch(obj, [{"op": "move", "from": "/a/0", "path": "/b/-"}])
    assert obj == {"a": [], "b": [{"n": 0}, {"n": 1}]}


def test_gpu_goes_to_the_sidecar_in_example(rendered: dict[str, list[Obj]]) -> None:
    """In the example the device plugin's GPU is the sidecar's; no shared PID namespace."""
    objs = rendered["example"]
    spec = one(objs, "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    assert container(objs, "nccl-back-worker", "nccl-back")["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert "shareProcessNamespace" not in spec


def test_shared_gpu_overlay_claims_one_gpu_for_both(rendered: dict[str, list[Obj]]) -> None:
    """shared-gpu: one DRA claim for both containers, no device-plugin GPU, shared PIDs."""
    objs = rendered["shared-gpu"]
    spec = one(objs, "Deployment", "nccl-back-worker")["spec"]["template"]["spec"]
    template = one(objs, "ResourceClaimTemplate", "nccl-back-gpu")
    assert template["metadata"]["namespace"] == one(objs, "Deployment", "nccl-back-worker")[
        "metadata"]["namespace"]
    assert spec["resourceClaims"] == [{"name": "gpu", "resourceClaimTemplateName": "nccl-back-gpu"}]
    both = [*spec["initContainers"], *spec["containers"]]
    assert [c["name"] for c in both] == ["nccl-back", "inference"]
    for c in both:
        assert c["resources"]["claims"] == [{"name": "gpu"}]
        assert "nvidia.com/gpu" not in c["resources"].get("limits", {})
    assert spec["shareProcessNamespace"] is True


def test_renderer_refuses_unsupported_fields(tmp_path: Path) -> None:
    """A kustomization field the renderer does not implement fails instead of being ignored."""
    (tmp_path / "kustomization.yaml").write_text("resources: []\ncommonLabels: {a: b}\n")
    with pytest.raises(NotImplementedError, match=r"does not support \['commonLabels'\]"):
        render(tmp_path)

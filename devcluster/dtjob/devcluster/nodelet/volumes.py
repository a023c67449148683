"""A pod's volumes as host directories, and each container's bind-mount plan.

Supported: emptyDir, hostPath, persistentVolumeClaim (bound to a hostPath or local
PersistentVolume), configMap, secret, downwardAPI, and projected (serviceAccountToken, configMap,
secret, downwardAPI) - which covers the service-account token volume that admission adds to every
pod. Anything else fails the pod with reason UnsupportedVolume.
"""

from __future__ import annotations

import asyncio
import base64
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dtjob.devcluster.nodelet.env import expand, field_ref
from dtjob.devcluster.nodelet.kubeapi import ApiError, KubeApi
from dtjob.devcluster.nodelet.state import NodeState

Obj = dict[str, Any]

SUPPORTED = (
    "emptyDir",
    "hostPath",
    "persistentVolumeClaim",
    "configMap",
    "secret",
    "downwardAPI",
    "projected",
)
# What the kubelet asks for when a projected token names no expiry (one hour and seven seconds).
DEFAULT_TOKEN_EXPIRY_S = 3607
# How long a TokenRequest refused by the node authorizer is retried (its graph sees a new pod's
# binding within milliseconds; 10 s covers an API server under load).
TOKEN_RETRY_SECONDS = 10.0
ROOT_CA_CONFIGMAP = "kube-root-ca.crt"


class VolumeError(Exception):
    """The pod cannot run: its volumes are invalid or unsupported. Fails the pod."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


class VolumeNotReady(Exception):
    """A volume's source is not there yet (unbound claim, missing ConfigMap): try again later."""


@dataclass(frozen=True)
class HostVolume:
    path: Path
    read_only: bool = False


def volume_type(volume: Obj) -> str:
    kinds = [k for k in volume if k != "name"]
    return kinds[0] if kinds else "emptyDir"


def check_supported(pod: Obj) -> None:
    for v in pod["spec"].get("volumes") or []:
        kind = volume_type(v)
        if kind not in SUPPORTED:
            raise VolumeError(
                "UnsupportedVolume",
                f"volume {v['name']!r} has type {kind!r}, which the dtjob devcluster does not support "
                f"(supported: {', '.join(SUPPORTED)})",
            )


def mount_plan(container: Obj, volumes: dict[str, HostVolume], env: dict[str, str]) -> list[dict[str, Any]]:
    """The bind mounts of one container: {source, target, readOnly} in volumeMounts order."""
    plan = []
    for m in container.get("volumeMounts") or []:
        vol = volumes.get(m["name"])
        if vol is None:
            raise VolumeError("InvalidVolumeMount", f"volumeMount {m['name']!r} names no volume of the pod")
        source = vol.path
        sub = m.get("subPath") or expand(m.get("subPathExpr", ""), env)
        if sub:
            if sub.startswith("/") or ".." in Path(sub).parts:
                raise VolumeError(
                    "InvalidVolumeMount", f"subPath {sub!r} must be a relative path inside the volume"
                )
            source = vol.path / sub
            if not source.exists():
                source.mkdir(parents=True, exist_ok=True)
        plan.append(
            {
                "source": str(source),
                "target": m["mountPath"],
                "readOnly": vol.read_only or bool(m.get("readOnly")),
            }
        )
    return plan


def write_files(directory: Path, files: dict[str, bytes], mode: int) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for rel, data in files.items():
        path = directory / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def select_items(
    data: dict[str, bytes], items: list[Obj] | None, what: str, optional: bool
) -> dict[str, bytes]:
    """The files of a configMap/secret volume: every key, or the listed keys at their paths."""
    if not items:
        return dict(data)
    out = {}
    for item in items:
        if item["key"] not in data:
            if optional:
                continue
            raise VolumeNotReady(f"{what} has no key {item['key']!r}")
        out[item["path"]] = data[item["key"]]
    return out


class VolumeBuilder:
    """Materialises one pod's volumes under the node's state directory."""

    def __init__(self, api: KubeApi, state: NodeState, pod: Obj, ca_cert: Path) -> None:
        self.api = api
        self.state = state
        self.pod = pod
        self.ca_cert = ca_cert
        self.ns = pod["metadata"]["namespace"]
        self.uid = pod["metadata"]["uid"]

    async def build(self) -> dict[str, HostVolume]:
        check_supported(self.pod)
        return {v["name"]: await self._one(v) for v in self.pod["spec"].get("volumes") or []}

    async def _one(self, v: Obj) -> HostVolume:
        kind, name = volume_type(v), v["name"]
        own = self.state.volume_dir(self.uid, name)
        if kind == "emptyDir":
            own.mkdir(parents=True, exist_ok=True)
            own.chmod(0o777)  # as the kubelet's: writable whatever user the container runs as
            return HostVolume(own)
        if kind == "hostPath":
            return HostVolume(host_path(v["hostPath"], name))
        if kind == "persistentVolumeClaim":
            return await self._claim(v["persistentVolumeClaim"], name)
        src = v[kind]
        files: dict[str, bytes] = {}
        if kind == "projected":
            for source in src.get("sources") or []:
                files.update(await self._projection(source))
        else:
            files = await self._projection({kind: src})
        write_files(own, files, int(src.get("defaultMode", 0o644)))
        return HostVolume(own, read_only=True)

    async def _claim(self, ref: Obj, name: str) -> HostVolume:
        claim = await self._get(f"/api/v1/namespaces/{self.ns}/persistentvolumeclaims/{ref['claimName']}")
        if claim is None or claim.get("status", {}).get("phase") != "Bound":
            raise VolumeNotReady(f"persistentVolumeClaim {ref['claimName']!r} is not bound")
        pv = await self._get(f"/api/v1/persistentvolumes/{claim['spec']['volumeName']}")
        if pv is None:
            raise VolumeNotReady(f"persistentVolume {claim['spec']['volumeName']!r} not found")
        spec = pv["spec"]
        path = (spec.get("hostPath") or spec.get("local") or {}).get("path")
        if not path:
            raise VolumeError(
                "UnsupportedVolume",
                f"volume {name!r}: persistentVolume {pv['metadata']['name']!r} is neither hostPath nor local",
            )
        if not Path(path).exists():
            # Created as a local-volume provisioner does, writable by any user: the pod's user
            # (trainers run as non-root) is not known when the PersistentVolume is made.
            Path(path).mkdir(parents=True, exist_ok=True)
            Path(path).chmod(0o777)
        return HostVolume(host_path({"path": path, "type": "Directory"}, name), bool(ref.get("readOnly")))

    async def _projection(self, source: Obj) -> dict[str, bytes]:
        if "serviceAccountToken" in source:
            return {source["serviceAccountToken"]["path"]: await self._token(source["serviceAccountToken"])}
        if "configMap" in source:
            ref = source["configMap"]
            cm = await self._get(f"/api/v1/namespaces/{self.ns}/configmaps/{ref['name']}")
            if cm is None and ref["name"] == ROOT_CA_CONFIGMAP:
                # The controller-manager publishes it shortly after start; it holds the cluster CA.
                cm = {"data": {"ca.crt": self.ca_cert.read_text()}}
            data = {k: v.encode() for k, v in ((cm or {}).get("data") or {}).items()}
            data.update({k: base64.b64decode(v) for k, v in ((cm or {}).get("binaryData") or {}).items()})
            return self._items(cm, data, ref, f"configMap {ref['name']!r}")
        if "secret" in source:
            ref = source["secret"]
            name = ref.get("secretName") or ref.get("name")
            secret = await self._get(f"/api/v1/namespaces/{self.ns}/secrets/{name}")
            data = {k: base64.b64decode(v) for k, v in ((secret or {}).get("data") or {}).items()}
            return self._items(secret, data, ref, f"secret {name!r}")
        if "downwardAPI" in source:
            out = {}
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise VolumeError(
                        "UnsupportedVolume", f"downwardAPI item {item['path']!r}: only fieldRef is supported"
                    )
                out[item["path"]] = field_ref(self.pod, item["fieldRef"]["fieldPath"]).encode()
            return out
        raise VolumeError("UnsupportedVolume", f"projected source {sorted(source)} is not supported")

    def _items(self, obj: Obj | None, data: dict[str, bytes], ref: Obj, what: str) -> dict[str, bytes]:
        if obj is None and not ref.get("optional"):
            raise VolumeNotReady(f"{what} not found")
        return select_items(data, ref.get("items"), what, bool(ref.get("optional")))

    async def _token(self, src: Obj) -> bytes:
        """A token for the pod's ServiceAccount, bound to the pod, from the TokenRequest API."""
        sa = self.pod["spec"].get("serviceAccountName") or "default"
        spec: Obj = {
            "expirationSeconds": int(src.get("expirationSeconds") or DEFAULT_TOKEN_EXPIRY_S),
            "boundObjectRef": {
                "apiVersion": "v1",
                "kind": "Pod",
                "name": self.pod["metadata"]["name"],
                "uid": self.uid,
            },
        }
        if src.get("audience"):
            spec["audiences"] = [src["audience"]]
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        path = f"/api/v1/namespaces/{self.ns}/serviceaccounts/{sa}/token"
        # The node authorizer lets a node ask for the token of a pod bound to it only once its graph
        # has seen the binding: a pod started the moment it is bound can be refused (403, "no
        # relationship found between node ... and this serviceaccount"; seen once in a CI run).
        # The kubelet's token manager retries; so does this, for up to TOKEN_RETRY_SECONDS.
        deadline = asyncio.get_running_loop().time() + TOKEN_RETRY_SECONDS
        while True:
            try:
                answer = await self.api.request("POST", path, body=body)
                return str(answer["status"]["token"]).encode()
            except ApiError as e:
                if e.status != 403 or asyncio.get_running_loop().time() >= deadline:
                    raise
            await asyncio.sleep(0.2)

    async def _get(self, path: str) -> Obj | None:
        try:
            return await self.api.get(path)
        except ApiError as e:
            if e.status == 404:
                return None
            raise


def host_path(src: Obj, name: str) -> Path:
    """A hostPath volume's path, created or checked according to its `type`."""
    path, kind = Path(src["path"]), src.get("type") or ""
    if kind in ("", "DirectoryOrCreate") and not path.exists():
        # Docker and the kubelet create a missing host directory for an untyped hostPath too.
        path.mkdir(parents=True, exist_ok=True)
        if kind == "DirectoryOrCreate":
            path.chmod(0o755)
    elif kind == "FileOrCreate" and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o644)
    checks = {
        "Directory": path.is_dir,
        "File": path.is_file,
        "DirectoryOrCreate": path.is_dir,
        "FileOrCreate": path.is_file,
    }
    ok = checks[kind]() if kind in checks else path.exists()
    if not ok:
        raise VolumeError(
            "InvalidHostPath", f"volume {name!r}: hostPath {path} is not a {kind or 'path'} on the node"
        )
    return path

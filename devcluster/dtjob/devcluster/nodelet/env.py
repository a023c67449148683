"""A container's environment and command line, resolved the way the kubelet does.

Pure functions: the ConfigMaps and Secrets a container refers to are fetched beforehand and passed
in as {name: {key: value}} maps.
"""

from __future__ import annotations

import math
import os
import re
import sys
from pathlib import Path
from typing import Any

Obj = dict[str, Any]

# The image is not pulled: commands run with this checkout's Python environment, so its bin
# directory (the venv of the running interpreter) comes first on PATH and `python` is the venv's.
VENV_BIN = str(Path(sys.executable).parent)
SYSTEM_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"


class EnvError(Exception):
    """A container's env cannot be resolved (a missing key or an unsupported field)."""


def base_env(hostname: str, api_host: str, api_port: str) -> dict[str, str]:
    """What a container gets before its own `env`: what an image and the kubelet would set, and
    the nodelet's PYTHONPATH (the checkout's source roots when it runs without an install)."""
    inherited = {"PYTHONPATH": os.environ["PYTHONPATH"]} if os.environ.get("PYTHONPATH") else {}
    return {
        **inherited,
        "PATH": f"{VENV_BIN}:{SYSTEM_PATH}",
        "HOME": "/root",
        "HOSTNAME": hostname,
        "LANG": "C.UTF-8",
        # Images of Python programs set this so logs stream; the devcluster runs no image, so it
        # sets it here (a pod's own env can override it).
        "PYTHONUNBUFFERED": "1",
        # Where pods reach the API server: the node IP (the bridge address) and the API port.
        "KUBERNETES_SERVICE_HOST": api_host,
        "KUBERNETES_SERVICE_PORT": api_port,
        "KUBERNETES_SERVICE_PORT_HTTPS": api_port,
        "KUBERNETES_PORT": f"tcp://{api_host}:{api_port}",
    }


def field_ref(pod: Obj, path: str) -> str:
    """Value of a downward-API fieldRef path (metadata.name, metadata.labels['k'], status.podIP, ...)."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    simple = {
        "metadata.name": meta.get("name"),
        "metadata.namespace": meta.get("namespace"),
        "metadata.uid": meta.get("uid"),
        "spec.nodeName": spec.get("nodeName"),
        "spec.serviceAccountName": spec.get("serviceAccountName"),
        "status.podIP": status.get("podIP"),
        "status.hostIP": status.get("hostIP"),
        "status.podIPs": ",".join(p["ip"] for p in status.get("podIPs") or []),
        "status.hostIPs": ",".join(p["ip"] for p in status.get("hostIPs") or []),
    }
    if path in ("metadata.labels", "metadata.annotations"):
        items = meta.get(path.split(".")[1], {})
        return "\n".join(f'{k}="{v}"' for k, v in sorted(items.items()))
    if path not in simple:
        raise EnvError(f"fieldRef.fieldPath {path!r} is not supported")
    return str(simple[path] or "")


_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "k": 10**3, "M": 10**6, "G": 10**9, "m": 1e-3}


def quantity(value: str) -> float:
    """A resource quantity ("500m", "2Gi", "4") as a number."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(value).strip())
    if not m or (m.group(2) and m.group(2) not in _UNITS):
        raise EnvError(f"cannot read resource quantity {value!r}")
    return float(m.group(1)) * _UNITS.get(m.group(2), 1)


def resource_ref(container: Obj, ref: Obj) -> str:
    """resourceFieldRef (limits.cpu, requests.memory, ...): the value in units of `divisor`, rounded
    up as the kubelet does."""
    kind, _, name = ref["resource"].partition(".")
    resources = container.get("resources", {})
    value = resources.get(kind, {}).get(name) or resources.get("limits", {}).get(name) or "0"
    return str(math.ceil(quantity(value) / quantity(ref.get("divisor") or "1")))


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: defined variables are replaced, `$$` is a literal `$` (so
    $$(VAR) stays $(VAR)), undefined references are left as they are."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1) == "$":
            return "$"
        return env.get(m.group(2), m.group(0))

    return re.sub(r"\$(\$|\(([A-Za-z_][A-Za-z0-9_.-]*)\))", sub, text)


def _key(source: dict[str, dict[str, str]], kind: str, ref: Obj) -> str | None:
    data = source.get(ref["name"])
    if data is None or ref["key"] not in data:
        if ref.get("optional"):
            return None
        raise EnvError(f"{kind} {ref['name']!r} key {ref['key']!r} not found")
    return data[ref["key"]]


def container_env(
    pod: Obj,
    container: Obj,
    configmaps: dict[str, dict[str, str]],
    secrets: dict[str, dict[str, str]],
    api: tuple[str, str],
) -> dict[str, str]:
    """The container's full environment: base, then envFrom, then env (later entries win)."""
    hostname = pod["spec"].get("hostname") or pod["metadata"]["name"]
    env = base_env(hostname, *api)
    for src in container.get("envFrom") or []:
        prefix = src.get("prefix", "")
        for kind, store in (("configMapRef", configmaps), ("secretRef", secrets)):
            if kind in src:
                data = store.get(src[kind]["name"])
                if data is None and not src[kind].get("optional"):
                    raise EnvError(f"envFrom {kind} {src[kind]['name']!r} not found")
                env.update({prefix + k: v for k, v in (data or {}).items()})
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(var.get("value", ""), env)
        elif "fieldRef" in source:
            env[var["name"]] = field_ref(pod, source["fieldRef"]["fieldPath"])
        elif "resourceFieldRef" in source:
            env[var["name"]] = resource_ref(container, source["resourceFieldRef"])
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            is_cm = "configMapKeyRef" in source
            value = _key(
                configmaps if is_cm else secrets,
                "configMap" if is_cm else "secret",
                source["configMapKeyRef" if is_cm else "secretKeyRef"],
            )
            if value is not None:
                env[var["name"]] = value
        else:
            raise EnvError(f"env {var['name']!r}: valueFrom {sorted(source)} is not supported")
    return env


def command_line(container: Obj, env: dict[str, str]) -> list[str]:
    """command + args with $(VAR) expanded. The image is not pulled, so its ENTRYPOINT is unknown:
    a container must name its command."""
    command = container.get("command") or []
    if not command:
        raise EnvError(
            f"container {container['name']!r} has no `command`: the devcluster runs no image, so set "
            "command (e.g. [python, -m, ...])"
        )
    return [expand(a, env) for a in [*command, *(container.get("args") or [])]]


def referenced_names(pod: Obj) -> tuple[set[str], set[str]]:
    """(ConfigMap names, Secret names) that the pod's containers' env refers to."""
    cms: set[str] = set()
    secrets: set[str] = set()
    for c in [*pod["spec"].get("initContainers", []), *pod["spec"].get("containers", [])]:
        for src in c.get("envFrom") or []:
            if "configMapRef" in src:
                cms.add(src["configMapRef"]["name"])
            if "secretRef" in src:
                secrets.add(src["secretRef"]["name"])
        for var in c.get("env") or []:
            vf = var.get("valueFrom") or {}
            if "configMapKeyRef" in vf:
                cms.add(vf["configMapKeyRef"]["name"])
            if "secretKeyRef" in vf:
                secrets.add(vf["secretKeyRef"]["name"])
    return cms, secrets

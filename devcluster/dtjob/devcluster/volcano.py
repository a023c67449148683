"""Volcano in the devcluster (`up --volcano`): its CRDs, the `root` and `default` queues, and
vc-controller-manager and vc-scheduler as host processes, each with a client certificate of its
own and the RBAC it needs (nothing it does not), like the other controllers.

The binaries, CRDs and scheduler configurations come from Volcano's release source (found by
volcano_source.py; built and copied into the cache by build-binaries.sh --volcano).

Left out: Volcano's admission webhooks (vc-webhook-manager). They need a serving certificate the
API server trusts and a Service the API server can reach, and this cluster has no kube-proxy, so
ClusterIPs do not route. What they would add here: defaults and checks on Volcano objects (a
PodGroup naming a queue that does not exist or is closed is refused at creation; a Queue's
weight/capability are validated). Without them such a PodGroup is created and the scheduler
leaves it Pending, and the operator shows that on the job.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from dtjob.devcluster import pki
from dtjob.devcluster.apiclient import ApiClient
from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.layout import (
    VOLCANO_CONTROLLER_MANAGER_HEALTHZ_PORT,
    VOLCANO_CONTROLLER_MANAGER_METRICS_PORT,
    VOLCANO_SCHEDULER_HEALTHZ_PORT,
    VOLCANO_SCHEDULER_METRICS_PORT,
    Layout,
)

COMPONENTS = ("vc-controller-manager", "vc-scheduler")
# The controllers dtjob's PodGroups need: the queue controller opens queues (the scheduler
# refuses every job of a queue whose state is not Open) and keeps their status; the PodGroup
# controller gives a plain pod with schedulerName volcano a PodGroup of its own, as in any Volcano
# install. The Volcano Job controllers (job, gc, cronjob, jobflow, jobtemplate) would need the
# rights to create pods and Services in every namespace and serve nothing dtjob makes.
CONTROLLERS = "queue-controller,pg-controller"
# Of the release's two scheduler configurations, the one its own e2e suite runs: it adds the
# preempt and reclaim actions (priority and queue preemption) to the default one's enqueue,
# allocate and backfill. Without `enqueue`, as Volcano's own preemption e2e tests run it
# (volcano-sh/volcano#3639; #991: "if users need preempt, enqueue should be disabled"): enqueue
# admits a PodGroup only while its minResources fit beside what is allocated, so in a full cluster
# a job of higher priority stays Pending and the preempt action, which skips Pending jobs, never
# runs for it. allocate then admits PodGroups itself and still enforces queue capabilities; what
# enqueue adds (no pods before admission) is for Volcano Jobs, and dtjob creates its pods anyway.
SCHEDULER_CONF = "volcano-scheduler-ci.conf"
LEFT_OUT_ACTIONS = ("enqueue",)
# klog verbosity of vc-scheduler: 3 logs each eviction ("Evicting pod ... because of ...") and
# each gang decision, which is what one reads the log for here.
SCHEDULER_VERBOSITY = "3"
QUEUES = ("root", "default")
USERS = {
    "vc-controller-manager": "dtjob:volcano-controller-manager",
    "vc-scheduler": "dtjob:volcano-scheduler",
}
HEALTH_PORTS = {
    "vc-controller-manager": VOLCANO_CONTROLLER_MANAGER_HEALTHZ_PORT,
    "vc-scheduler": VOLCANO_SCHEDULER_HEALTHZ_PORT,
}
PORTS = {
    "vc-controller-manager": (
        VOLCANO_CONTROLLER_MANAGER_HEALTHZ_PORT,
        VOLCANO_CONTROLLER_MANAGER_METRICS_PORT,
    ),
    "vc-scheduler": (VOLCANO_SCHEDULER_HEALTHZ_PORT, VOLCANO_SCHEDULER_METRICS_PORT),
}
RBAC_API = "rbac.authorization.k8s.io"
CRD_API = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
QUEUE_API = "/apis/scheduling.volcano.sh/v1beta1/queues"
READ = ["get", "list", "watch"]


def _rule(group: str, resources: list[str], verbs: list[str]) -> dict[str, Any]:
    return {"apiGroups": [group], "resources": resources, "verbs": verbs}


# What each component calls, read from its informers and clients in the v1.15.1 source.
RULES: dict[str, list[dict[str, Any]]] = {
    "vc-scheduler": [
        # bind, evict (delete), and the Unschedulable / DisruptionTarget conditions on pods
        _rule("", ["pods"], [*READ, "delete", "patch"]),
        _rule("", ["pods/status"], ["update", "patch"]),
        _rule("", ["pods/binding"], ["create"]),
        _rule("", ["events"], ["create", "patch", "update"]),
        # what its predicates, volume binding and quota plugins read
        _rule("", ["nodes", "namespaces", "services", "replicationcontrollers", "resourcequotas"], READ),
        _rule("", ["persistentvolumeclaims", "persistentvolumes"], READ),
        _rule("apps", ["replicasets", "statefulsets"], READ),
        _rule("policy", ["poddisruptionbudgets"], READ),
        _rule(
            "storage.k8s.io",
            ["storageclasses", "csinodes", "csidrivers", "csistoragecapacities", "volumeattachments"],
            READ,
        ),
        _rule("scheduling.k8s.io", ["priorityclasses"], READ),
        _rule(
            "resource.k8s.io", ["resourceclaims", "resourceslices", "deviceclasses", "devicetaintrules"], READ
        ),
        # PodGroups have no status subresource: the scheduler updates the whole object
        _rule("scheduling.volcano.sh", ["podgroups"], [*READ, "update"]),
        _rule("scheduling.volcano.sh", ["queues"], READ),
        _rule("scheduling.volcano.sh", ["queues/status"], ["update", "patch"]),
        _rule("nodeinfo.volcano.sh", ["numatopologies"], READ),
        _rule("topology.volcano.sh", ["hypernodes"], READ),
    ],
    "vc-controller-manager": [
        _rule("", ["pods"], [*READ, "patch"]),
        _rule("", ["events"], ["create", "patch", "update"]),
        _rule("apps", ["replicasets", "statefulsets"], READ),
        _rule("scheduling.volcano.sh", ["podgroups"], [*READ, "create", "update"]),
        # the queue controller opens a queue with a patch of the queue itself
        _rule("scheduling.volcano.sh", ["queues"], [*READ, "update", "patch"]),
        _rule("scheduling.volcano.sh", ["queues/status"], ["update", "patch"]),
        _rule("bus.volcano.sh", ["commands"], [*READ, "delete"]),
    ],
}


def role_name(component: str) -> str:
    return f"dtjob:{component}"


def rbac_objects() -> list[dict[str, Any]]:
    """A ClusterRole and a ClusterRoleBinding to its user per component."""
    objects: list[dict[str, Any]] = []
    for component, rules in RULES.items():
        name = role_name(component)
        objects.append(
            {
                "apiVersion": f"{RBAC_API}/v1",
                "kind": "ClusterRole",
                "metadata": {"name": name},
                "rules": rules,
            }
        )
        objects.append(
            {
                "apiVersion": f"{RBAC_API}/v1",
                "kind": "ClusterRoleBinding",
                "metadata": {"name": name},
                "roleRef": {"apiGroup": RBAC_API, "kind": "ClusterRole", "name": name},
                "subjects": [{"apiGroup": RBAC_API, "kind": "User", "name": USERS[component]}],
            }
        )
    return objects


def ensure_pki(layout: Layout) -> None:
    """Each component's client certificate (its user name, no groups) and kubeconfig."""
    from dtjob.devcluster.controlplane import APISERVER_URL

    ca = pki.ensure_ca(layout.pki)
    for component, user in USERS.items():
        cert = pki.ensure_cert(
            ca,
            pki.CertKey(layout.pki / f"{component}.crt", layout.pki / f"{component}.key"),
            user,
            client=True,
        )
        if not layout.kubeconfig(component).exists():
            pki.write_kubeconfig(layout.kubeconfig(component), APISERVER_URL, ca.cert, cert, user)


def command(component: str, layout: Layout, binaries: Binaries) -> list[str]:
    kubeconfig = layout.kubeconfig(component)
    healthz, metrics = PORTS[component]
    common = [
        f"--kubeconfig={kubeconfig}",
        "--leader-elect=false",
        "--enable-healthz=true",
        f"--healthz-address=127.0.0.1:{healthz}",
        f"--listen-address=127.0.0.1:{metrics}",
    ]
    if component == "vc-controller-manager":
        return [str(binaries.volcano_path(component)), *common, f"--controllers={CONTROLLERS}"]
    if component == "vc-scheduler":
        return [
            str(binaries.volcano_path(component)),
            *common,
            f"--scheduler-conf={layout.volcano_dir / SCHEDULER_CONF}",
            f"--cache-dump-dir={layout.volcano_dir}",
            f"-v={SCHEDULER_VERBOSITY}",
        ]
    raise ValueError(f"unknown Volcano component {component!r}")


def write_scheduler_conf(layout: Layout, binaries: Binaries) -> Path:
    """The release's SCHEDULER_CONF without LEFT_OUT_ACTIONS, where vc-scheduler reads it."""
    source = binaries.volcano_dir / "config" / SCHEDULER_CONF
    conf = yaml.safe_load(source.read_text())
    actions = [a.strip() for a in str(conf["actions"]).split(",")]
    conf["actions"] = ", ".join(a for a in actions if a not in LEFT_OUT_ACTIONS)
    target = layout.volcano_dir / SCHEDULER_CONF
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(f"# {source} without {', '.join(LEFT_OUT_ACTIONS)} (dtjob.devcluster.volcano)\n")
    with target.open("a") as out:
        yaml.safe_dump(conf, out, sort_keys=False)
    return target


def environment(layout: Layout, base: Mapping[str, str]) -> dict[str, str]:
    """vc-scheduler opens a unix socket for changing its log level in $DEBUG_SOCKET_DIR (default
    /tmp/klog-socks): inside the state directory, so `down` leaves nothing behind."""
    return {**base, "DEBUG_SOCKET_DIR": str(layout.volcano_dir / "klog-socks")}


def healthy(component: str, timeout: float = 3.0) -> bool:
    url = f"http://127.0.0.1:{HEALTH_PORTS[component]}/healthz"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return bool(response.read().decode(errors="replace").strip() == "ok")
    except OSError:
        return False


def crd_files(binaries: Binaries) -> list[Path]:
    files = sorted((binaries.volcano_dir / "crd").glob("*.yaml"))
    if not files:
        raise DevclusterError(
            f"no Volcano CRDs in {binaries.volcano_dir / 'crd'}; "
            "`bash devcluster/build-binaries.sh --volcano` puts them there"
        )
    return files


def install(layout: Layout, binaries: Binaries, timeout: float) -> None:
    """RBAC, CRDs (server-side apply: the release's version replaces an older one), and the
    root and default queues, before any Volcano component starts."""
    client = ApiClient(layout, timeout=30.0)
    for obj in rbac_objects():
        url = f"/apis/{RBAC_API}/v1/{obj['kind'].lower()}s/{obj['metadata']['name']}"
        _check(client.apply(url, obj), f"{obj['kind']} {obj['metadata']['name']}")
    names = []
    for path in crd_files(binaries):
        crd = yaml.safe_load(path.read_text())
        names.append(crd["metadata"]["name"])
        _check(client.apply(f"{CRD_API}/{crd['metadata']['name']}", crd), f"CRD {path.name}")
    _wait("Volcano's CRDs to be Established", lambda: all(_established(client, n) for n in names), timeout)
    for queue in QUEUES:
        status = client.create(QUEUE_API, _queue(queue))
        if status not in (200, 201, 409):
            raise DevclusterError(f"creating the Volcano queue {queue!r} failed with HTTP {status}")


def _queue(name: str) -> dict[str, Any]:
    """As vc-scheduler would create it: the root queue not reclaimable, the default one reclaimable."""
    return {
        "apiVersion": "scheduling.volcano.sh/v1beta1",
        "kind": "Queue",
        "metadata": {"name": name},
        "spec": {"weight": 1, "reclaimable": name != "root"},
    }


def queue_state(layout: Layout, name: str) -> str | None:
    status, body = ApiClient(layout).get(f"{QUEUE_API}/{name}")
    if status != 200:
        return None
    return str((json.loads(body).get("status") or {}).get("state") or "") or None


def _established(client: ApiClient, name: str) -> bool:
    status, body = client.get(f"{CRD_API}/{name}")
    if status != 200:
        return False
    conditions = (json.loads(body).get("status") or {}).get("conditions") or []
    return any(c.get("type") == "Established" and c.get("status") == "True" for c in conditions)


def _check(status: int, what: str) -> None:
    if status not in (200, 201):
        raise DevclusterError(f"applying {what} failed with HTTP {status}")


def _wait(what: str, check: Any, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    raise DevclusterError(f"timed out after {timeout:.0f}s waiting for {what}")

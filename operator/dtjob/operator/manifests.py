"""Manifests of a job's children: worker pods, the headless Service and the Volcano PodGroup.

Pure functions of the job (a JobView) and of what they are given (the installer's worker defaults),
so the reconciler can decide with them and the unit tests
can check them without a cluster. What each worker pod gets (environment, labels, ports) is
tabled in docs/design.md.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from decimal import Decimal
from typing import Any

from dtjob import contract
from dtjob.operator import in_place
from dtjob.operator.jobview import (
    API_VERSION,
    KIND,
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    LABEL_RANK,
    MANAGED_BY,
    TRAINER_CONTAINER,
    JobView,
)
from dtjob.operator.quantity import format_quantity, parse_quantity, stringify_quantities
from dtjob.operator.worker_defaults import WorkerDefaults

PODGROUP_API_VERSION = "scheduling.volcano.sh/v1beta1"
PODGROUP_ANNOTATION = "scheduling.k8s.io/group-name"
CHECKPOINT_VOLUME_NAME = "checkpoint"
# In-memory snapshots (trainer/snapshot.py): a tmpfs of the pod's, outliving its trainer processes.
SNAPSHOT_VOLUME_NAME = "dtjob-snapshots"


def worker_name(job_name: str, rank: int) -> str:
    return f"{job_name}-worker-{rank}"


def master_addr(job: JobView) -> str:
    """Rank 0's stable DNS name through the headless Service."""
    return f"{worker_name(job.name, 0)}.{job.name}.{job.namespace}.svc"


def owner_reference(job: JobView) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def selector_labels(job: JobView) -> dict[str, str]:
    return {LABEL_JOB: job.name}


def agent_port(job: JobView) -> int:
    """The port pod 0's agent coordinates restarts in place on (dtjob.launcher.coordinator)."""
    return job.master_port + 1


def _trainer_env(
    job: JobView, rank: int, world_size: int, generation: int, restarts_left: int
) -> list[dict[str, Any]]:
    c = contract
    nproc = job.nproc_per_worker
    values = {
        c.ENV_MASTER_ADDR: master_addr(job),
        c.ENV_MASTER_PORT: str(job.master_port),
        # In processes; with several per pod, dtjob.launcher gives each its RANK and LOCAL_RANK.
        c.ENV_WORLD_SIZE: str(world_size * nproc),
        c.ENV_RANK: str(rank * nproc),
        c.ENV_LOCAL_RANK: "0",
        c.ENV_LOCAL_WORLD_SIZE: str(nproc),
        c.ENV_POD_RANK: str(rank),
        c.ENV_PODS: str(world_size),
        c.ENV_JOB_NAME: job.name,
        c.ENV_NAMESPACE: job.namespace,
        c.ENV_GENERATION: str(generation),
        c.ENV_JOB_UID: job.uid,
        c.ENV_CHECKPOINT_DIR: job.checkpoint_mount_path,
        c.ENV_METRICS_PORT: str(job.metrics_port),
        c.ENV_HEARTBEAT_TIMEOUT: str(job.heartbeat_timeout_seconds),
    }
    parallelism = job.spec.parallelism
    if parallelism is not None:  # declared: the trainer's --tensor-parallel / --pipeline-stages
        values[c.ENV_PARALLELISM_TENSOR] = str(parallelism.tensor)
        values[c.ENV_PARALLELISM_PIPELINE] = str(parallelism.pipeline)
    if job.restart_in_place:
        values[c.ENV_AGENT_PORT] = str(agent_port(job))
        values[c.ENV_RESTARTS_LEFT] = str(max(0, restarts_left))
        values[c.ENV_PERMANENT_EXIT_CODES] = ",".join(str(code) for code in job.permanent_exit_codes)
    return [{"name": k, "value": v} for k, v in values.items()]


def _merge_env(user_env: list[dict[str, Any]], ours: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Our contract variables win; the user's other variables are kept after them (so they can
    reference ours with $(VAR))."""
    our_names = {e["name"] for e in ours}
    return ours + [e for e in user_env if e.get("name") not in our_names]


def _avoid(spec: dict[str, Any], nodes: Sequence[str]) -> None:
    """Add `metadata.name NotIn [node]` for each node to the pod's required node affinity: to
    every term of the template's (terms are ORed, a term's requirements ANDed), or as the only
    term. One requirement per node: the API server refuses a field selector's NotIn with more
    than one value (found by the chaos suite, with two nodes silent at once)."""
    rules = [{"key": "metadata.name", "operator": "NotIn", "values": [node]} for node in nodes]
    affinity = spec.setdefault("affinity", {}).setdefault("nodeAffinity", {})
    required = affinity.setdefault("requiredDuringSchedulingIgnoredDuringExecution", {})
    terms = required.get("nodeSelectorTerms") or [{}]
    required["nodeSelectorTerms"] = [
        {**term, "matchFields": [*(term.get("matchFields") or []), *rules]} for term in terms
    ]


def _checkpoint_volume(job: JobView) -> dict[str, Any] | None:
    """spec.checkpoint.volume is a Volume (with or without a name); we name it ourselves."""
    source = job.checkpoint_volume
    if not source:
        return None
    volume = {k: copy.deepcopy(v) for k, v in source.items() if k != "name"}
    volume["name"] = str(source.get("name") or CHECKPOINT_VOLUME_NAME)
    return volume


def _run_through_launcher(container: dict[str, Any]) -> None:
    """Several processes per pod, or restarts in place: the container runs `python -m
    dtjob.launcher -- <its command>`, which starts LOCAL_WORLD_SIZE copies of it (the image's
    ENTRYPOINT when the template gives no command: the trainer image's `python -m dtjob.trainer`)."""
    command = list(container.get("command") or in_place.TRAINER_ENTRYPOINT)
    args = list(container.get("args") or [])
    container["command"] = ["python", "-m", "dtjob.launcher", "--", *command, *args]
    container.pop("args", None)


def worker_pod(
    job: JobView,
    rank: int,
    world_size: int,
    generation: int,
    defaults: WorkerDefaults,
    avoid_nodes: Sequence[str] = (),
    restarts_left: int = 0,
) -> dict[str, Any]:
    """The pod of one worker of one generation; `defaults` are the installer's worker defaults,
    `avoid_nodes` nodes it must not be placed on (required node affinity), `restarts_left` the
    restarts in place its gang may make (elastic.maxRestarts - status.restarts)."""
    template = copy.deepcopy(dict(job.template))
    meta = template.get("metadata") or {}
    spec: dict[str, Any] = template.get("spec") or {}
    name = worker_name(job.name, rank)
    labels = dict(meta.get("labels") or {})
    labels.update(
        {
            LABEL_JOB: job.name,
            LABEL_RANK: str(rank),
            LABEL_GENERATION: str(generation),
            LABEL_MANAGED_BY: MANAGED_BY,
        }
    )
    annotations = dict(meta.get("annotations") or {})
    if job.uses_podgroup:
        annotations[PODGROUP_ANNOTATION] = job.name

    spec["hostname"] = name
    spec["subdomain"] = job.name
    # The operator (or, in place, the pods' agents) restarts the whole gang; a kubelet restarting
    # one worker in place would leave it alone in a process group its peers already left.
    spec["restartPolicy"] = "Never"
    # The installer's defaults (helm chart values `workers.*`) fill what the template leaves unset.
    defaults.apply(spec)
    # Workers need no API access (the operator reads their progress from their metrics port):
    # no service account token unless the template asks for one.
    spec.setdefault("automountServiceAccountToken", False)
    if avoid_nodes:
        _avoid(spec, avoid_nodes)
    if job.scheduler_name:
        spec["schedulerName"] = job.scheduler_name
    if job.priority_class_name:
        spec.setdefault("priorityClassName", job.priority_class_name)
    # Non-root by default: the trainer image runs as uid 1000 (USER in its Dockerfile), so the
    # kubelet can enforce it without the operator picking a uid that the checkpoint volume's
    # owner might not match. A template that chooses a user keeps its choice.
    pod_security = spec.setdefault("securityContext", {})
    pod_security.setdefault("runAsNonRoot", True)

    volume = _checkpoint_volume(job)
    if volume is not None:
        volumes = [v for v in spec.get("volumes") or [] if v.get("name") != volume["name"]]
        spec["volumes"] = [*volumes, volume]
        # Snapshots need a checkpoint directory (they are newer checkpoints); memory-backed, so
        # they count against the container's memory limit, which the trainer checks them against.
        if not any(v.get("name") == SNAPSHOT_VOLUME_NAME for v in spec["volumes"]):
            spec["volumes"].append({"name": SNAPSHOT_VOLUME_NAME, "emptyDir": {"medium": "Memory"}})

    for container in [*(spec.get("initContainers") or []), *(spec.get("containers") or [])]:
        _quantities_as_strings(container)
    for container in spec.get("containers") or []:
        security = container.setdefault("securityContext", {})
        security.setdefault("allowPrivilegeEscalation", False)
        security.setdefault("capabilities", {"drop": ["ALL"]})
        if container.get("name") != TRAINER_CONTAINER:
            continue
        # A failed trainer's log tail becomes its terminated state's message, which the job's
        # event and condition quote (its last line) without reading the pod's log.
        container.setdefault("terminationMessagePolicy", "FallbackToLogsOnError")
        container["env"] = _merge_env(
            container.get("env") or [], _trainer_env(job, rank, world_size, generation, restarts_left)
        )
        if job.nproc_per_worker > 1 or job.restart_in_place:
            _run_through_launcher(container)
        ours = {"master": job.master_port, "metrics": job.metrics_port}
        if job.restart_in_place:
            ours["agent"] = agent_port(job)
        ports = [p for p in container.get("ports") or [] if p.get("name") not in ours]
        container["ports"] = [
            *ports,
            *({"name": name, "containerPort": port, "protocol": "TCP"} for name, port in ours.items()),
        ]
        if volume is not None:
            mounts = [m for m in container.get("volumeMounts") or [] if m.get("name") != volume["name"]]
            container["volumeMounts"] = [
                *mounts,
                {"name": volume["name"], "mountPath": job.checkpoint_mount_path},
            ]
            if not any(m.get("name") == SNAPSHOT_VOLUME_NAME for m in mounts):
                snapshots = next(
                    (e.get("value") for e in container["env"] if e.get("name") == contract.ENV_SNAPSHOT_DIR),
                    None,
                )  # the template's own DTJOB_SNAPSHOT_DIR, if it sets one
                container["volumeMounts"].append(
                    {"name": SNAPSHOT_VOLUME_NAME, "mountPath": snapshots or contract.DEFAULT_SNAPSHOT_DIR}
                )

    # The template may write a quantity as a number (`nvidia.com/gpu: 1`), which the API server
    # accepts and the kubernetes client refuses.
    stringify_quantities(spec)
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": job.namespace,
            "labels": labels,
            "annotations": annotations,
            "ownerReferences": [owner_reference(job)],
        },
        "spec": spec,
    }


def _quantities_as_strings(container: dict[str, Any]) -> None:
    """`nvidia.com/gpu: 1` is a valid quantity in a manifest (int-or-string) and the API server
    keeps the integer, but the Kubernetes client's Pod model takes strings only and refuses the
    whole pod. Written as a string it is the same quantity."""
    resources = container.get("resources") or {}
    for kind in ("requests", "limits"):
        values = resources.get(kind)
        if isinstance(values, dict):
            resources[kind] = {k: v if isinstance(v, str) else str(v) for k, v in values.items()}


def headless_service(job: JobView) -> dict[str, Any]:
    """The Service giving each worker the DNS name <job>-worker-<rank>.<job>.<ns>.svc, before the
    pods are ready (rendezvous happens before readiness)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": job.name,
            "namespace": job.namespace,
            "labels": {LABEL_JOB: job.name, LABEL_MANAGED_BY: MANAGED_BY},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": selector_labels(job),
            "ports": [
                {"name": "master", "port": job.master_port, "targetPort": job.master_port},
                {"name": "metrics", "port": job.metrics_port, "targetPort": job.metrics_port},
            ],
        },
    }


def pod_requests(template: Mapping[str, Any]) -> dict[str, Decimal]:
    """The resources one worker pod requests (sum over its containers; a limit without a request
    counts as the request, as the API server defaults it)."""
    total: dict[str, Decimal] = {}
    for container in (template.get("spec") or {}).get("containers") or []:
        resources = container.get("resources") or {}
        merged = dict(resources.get("limits") or {})
        merged.update(resources.get("requests") or {})
        for resource, quantity in merged.items():
            total[resource] = total.get(resource, Decimal(0)) + parse_quantity(quantity)
    return total


def podgroup(job: JobView, world_size: int) -> dict[str, Any]:
    """The Volcano PodGroup: the scheduler binds all `minMember` pods or none."""
    per_pod = pod_requests(job.template)
    spec: dict[str, Any] = {
        "minMember": world_size,
        "minResources": {r: format_quantity(q * world_size) for r, q in sorted(per_pod.items())},
    }
    if job.queue:
        spec["queue"] = job.queue
    if job.priority_class_name:
        spec["priorityClassName"] = job.priority_class_name
    return {
        "apiVersion": PODGROUP_API_VERSION,
        "kind": "PodGroup",
        "metadata": {
            "name": job.name,
            "namespace": job.namespace,
            "labels": {LABEL_JOB: job.name, LABEL_MANAGED_BY: MANAGED_BY},
            "ownerReferences": [owner_reference(job)],
        },
        "spec": spec,
    }

"""The worker pod's memory-backed volume for in-memory snapshots (trainer/snapshot.py): a pod's own
/dev/shm is 64 MiB, so the operator mounts an emptyDir of medium Memory at the snapshot directory."""

from __future__ import annotations

from typing import Any

from dtjob import contract
from dtjob.operator.jobview import JobView
from dtjob.operator.manifests import SNAPSHOT_VOLUME_NAME, worker_pod
from dtjob.operator.worker_defaults import WorkerDefaults
from tests.unit.reconciler_fixtures import make_job


def _pod(job: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    spec = worker_pod(JobView(job), rank=0, world_size=2, generation=1, defaults=WorkerDefaults())["spec"]
    return spec, spec["containers"][0]


def test_a_checkpointing_job_gets_a_memory_volume_at_the_snapshot_directory() -> None:
    spec, trainer = _pod(make_job())
    assert {"name": SNAPSHOT_VOLUME_NAME, "emptyDir": {"medium": "Memory"}} in spec["volumes"]
    assert {"name": SNAPSHOT_VOLUME_NAME, "mountPath": "/dev/shm/dtjob-snapshots"} in trainer["volumeMounts"]
    assert contract.PodEnv().snapshot_dir == "/dev/shm/dtjob-snapshots"  # where the trainer looks


def test_the_templates_snapshot_directory_is_where_the_volume_goes() -> None:
    job = make_job()
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["env"].append({"name": contract.ENV_SNAPSHOT_DIR, "value": "/mem/snaps"})
    _, trainer = _pod(job)
    assert {"name": SNAPSHOT_VOLUME_NAME, "mountPath": "/mem/snaps"} in trainer["volumeMounts"]


def test_without_checkpoints_there_is_no_snapshot_volume() -> None:
    job = make_job()
    del job["spec"]["checkpoint"]
    spec, trainer = _pod(job)
    assert all(v["name"] != SNAPSHOT_VOLUME_NAME for v in spec.get("volumes") or [])
    assert all(m["name"] != SNAPSHOT_VOLUME_NAME for m in trainer.get("volumeMounts") or [])

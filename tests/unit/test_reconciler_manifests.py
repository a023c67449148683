"""The children the reconciler creates (pods, Service, PodGroup) and its capacity count."""

from __future__ import annotations

from decimal import Decimal
from typing import Any

import pytest

from dtjob.api import DistributedTrainingJobSpec, InvalidJobError
from dtjob.operator.capacity import node_admits, workers_that_fit
from dtjob.operator.jobview import JobView
from dtjob.operator.manifests import headless_service, podgroup, worker_pod
from dtjob.operator.quantity import format_quantity, parse_quantity
from dtjob.operator.worker_defaults import WorkerDefaults
from tests.unit.reconciler_fixtures import env_of, make_job, make_node, make_pod


def test_worker_pod_has_the_design_names_labels_env_and_volume() -> None:
    pod = worker_pod(JobView(make_job()), rank=1, world_size=3, generation=2, defaults=WorkerDefaults())
    meta, spec = pod["metadata"], pod["spec"]
    assert meta["name"] == "gpt-worker-1" and meta["namespace"] == "ml"
    assert meta["labels"] == {
        "team": "ml",
        "training.dtjob.io/job-name": "gpt",
        "training.dtjob.io/rank": "1",
        "training.dtjob.io/generation": "2",
        "app.kubernetes.io/managed-by": "dtjob-operator",
    }
    owner = meta["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"], owner["controller"]) == (
        "DistributedTrainingJob",
        "gpt",
        "uid-1",
        True,
    )
    assert (spec["hostname"], spec["subdomain"], spec["restartPolicy"]) == ("gpt-worker-1", "gpt", "Never")
    env = env_of(pod)
    assert env == {
        "MASTER_ADDR": "gpt-worker-0.gpt.ml.svc",
        "MASTER_PORT": "29500",
        "WORLD_SIZE": "3",
        "RANK": "1",
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "DTJOB_POD_RANK": "1",
        "DTJOB_PODS": "3",
        "DTJOB_JOB_NAME": "gpt",
        "DTJOB_NAMESPACE": "ml",
        "DTJOB_GENERATION": "2",
        "DTJOB_JOB_UID": "uid-1",
        "DTJOB_CHECKPOINT_DIR": "/ckpt",
        "DTJOB_METRICS_PORT": "9400",
        "DTJOB_HEARTBEAT_TIMEOUT": "10",
        # dtjob's trainer: restarts in place, pod 0's agent on masterPort + 1
        "DTJOB_AGENT_PORT": "29501",
        "DTJOB_RESTARTS_LEFT": "0",
        "DTJOB_PERMANENT_EXIT_CODES": "2,126,127",
        "DTJOB_STEPS": "50",
    }, "contract variables override the template's (RANK=9 there), other variables stay"
    trainer = spec["containers"][0]
    assert {"name": "checkpoint", "mountPath": "/ckpt"} in trainer["volumeMounts"]
    assert {"name": "checkpoint", "hostPath": {"path": "/tmp/ckpt"}} in spec["volumes"]
    assert trainer["securityContext"]["allowPrivilegeEscalation"] is False
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert "schedulerName" not in spec
    assert spec["automountServiceAccountToken"] is False, "workers need no API access"


def test_a_pod_of_several_processes_runs_them_through_the_launcher() -> None:
    job = make_job()
    trainer = job["spec"]["template"]["spec"]["containers"][0]
    trainer["resources"] = {"limits": {"nvidia.com/gpu": "2"}}  # nprocPerWorker defaults to it
    trainer["command"], trainer["args"] = ["python", "-m", "dtjob.trainer"], ["--steps=5"]
    pod = worker_pod(JobView(job), rank=1, world_size=3, generation=0, defaults=WorkerDefaults())
    env = env_of(pod)
    assert (env["WORLD_SIZE"], env["RANK"], env["LOCAL_WORLD_SIZE"], env["DTJOB_POD_RANK"]) == (
        "6",
        "2",
        "2",
        "1",
    )
    container = pod["spec"]["containers"][0]
    assert container["command"] == [
        "python",
        "-m",
        "dtjob.launcher",
        "--",
        "python",
        "-m",
        "dtjob.trainer",
        "--steps=5",
    ]
    assert "args" not in container
    job["spec"]["nprocPerWorker"] = 3  # the field wins over the GPU count
    assert (
        env_of(worker_pod(JobView(job), rank=0, world_size=2, generation=0, defaults=WorkerDefaults()))[
            "WORLD_SIZE"
        ]
        == "6"
    )
    job["spec"]["nprocPerWorker"] = 1
    job["spec"]["elastic"]["restartInPlace"] = False
    one = worker_pod(JobView(job), rank=0, world_size=2, generation=0, defaults=WorkerDefaults())["spec"][
        "containers"
    ][0]
    assert one["command"] == ["python", "-m", "dtjob.trainer"], "one process: the command as written"
    assert [p["name"] for p in one["ports"]] == ["master", "metrics"]


def _trainer(pod: dict[str, Any]) -> dict[str, Any]:
    return dict(pod["spec"]["containers"][0])


def test_dtjobs_own_trainer_restarts_in_place_through_the_agent_unless_told_not_to() -> None:
    job = make_job()
    pod = worker_pod(
        JobView(job), rank=0, world_size=2, generation=0, defaults=WorkerDefaults(), restarts_left=2
    )
    container = _trainer(pod)
    assert container["command"] == ["python", "-m", "dtjob.launcher", "--", "python", "-m", "dtjob.trainer"]
    assert {"name": "agent", "containerPort": 29501, "protocol": "TCP"} in container["ports"]
    env = env_of(pod)
    assert (env["DTJOB_AGENT_PORT"], env["DTJOB_RESTARTS_LEFT"]) == ("29501", "2")

    job["spec"]["elastic"]["restartPolicy"] = "OnFailure"
    assert env_of(worker_pod(JobView(job), 0, 2, 0, WorkerDefaults()))["DTJOB_PERMANENT_EXIT_CODES"] == ""
    job["spec"]["elastic"]["restartPolicy"] = "Never"  # nothing restarts: no agent
    assert "DTJOB_AGENT_PORT" not in env_of(worker_pod(JobView(job), 0, 2, 0, WorkerDefaults()))

    own = make_job()
    _trainer_of(own)["command"] = ["python", "/script/train.py"]  # a user's script: only when asked
    assert _trainer(worker_pod(JobView(own), 0, 2, 0, WorkerDefaults()))["command"] == [
        "python",
        "/script/train.py",
    ]
    own["spec"]["elastic"]["restartInPlace"] = True
    assert _trainer(worker_pod(JobView(own), 0, 2, 0, WorkerDefaults()))["command"][:4] == [
        "python",
        "-m",
        "dtjob.launcher",
        "--",
    ]


def _trainer_of(job: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = job["spec"]["template"]["spec"]["containers"][0]
    return container


def test_template_is_not_mutated_by_building_pods() -> None:
    job = make_job()
    worker_pod(JobView(job), 0, 4, 0, WorkerDefaults())
    assert job == make_job()


def test_headless_service_publishes_not_ready_addresses() -> None:
    service = headless_service(JobView(make_job()))
    assert service["metadata"]["name"] == "gpt"
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"] is True
    assert service["spec"]["selector"] == {"training.dtjob.io/job-name": "gpt"}


def test_gang_flag_alone_selects_volcano() -> None:
    job = JobView(make_job(scheduling={"gang": True}))
    assert job.uses_podgroup and job.scheduler_name == "volcano"
    group = podgroup(job, 3)
    assert group["apiVersion"] == "scheduling.volcano.sh/v1beta1" and group["metadata"]["name"] == "gpt"
    assert group["spec"]["minMember"] == 3 and group["spec"]["minResources"] == {"cpu": "3"}


def test_capacity_counts_free_resources_on_ready_uncordoned_nodes() -> None:
    template = make_job(cpu="500m")["spec"]["template"]
    cordoned = make_node("n3")
    cordoned["spec"]["unschedulable"] = True
    nodes = [make_node("n1"), make_node("n2", ready=False), cordoned, make_node("n4", cpu="1500m")]
    other = make_pod(0, job="other", node="n1")  # takes 1 of n1's 2 cpus
    mine = make_pod(0, job="gpt", node="n4")  # the job's own pods do not count: they are replaced
    assert workers_that_fit("gpt", template, nodes, [other, mine]) == 2 + 3


def test_capacity_for_gpu_workers_counts_only_nodes_with_gpus() -> None:
    job = make_job()
    job["spec"]["template"]["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": 1}}
    gpu_node = make_node("g1")
    gpu_node["status"]["allocatable"]["nvidia.com/gpu"] = "2"
    assert workers_that_fit("gpt", job["spec"]["template"], [gpu_node, make_node("c1")], []) == 2


@pytest.mark.parametrize(
    ("text", "value"),
    [("2", Decimal(2)), ("500m", Decimal("0.5")), ("1Gi", Decimal(2**30)), ("1k", Decimal(1000))],
)
def test_quantities_parse(text: str, value: Decimal) -> None:
    assert parse_quantity(text) == value


def test_bad_quantity_names_the_value() -> None:
    with pytest.raises(ValueError, match="'lots'"):
        parse_quantity("lots")
    assert format_quantity(Decimal("1.5")) == "1500m" and format_quantity(Decimal(4)) == "4"


def test_jobview_defaults_come_from_the_api_model() -> None:
    job = make_job()
    job["spec"] = {"replicas": 3, "template": job["spec"]["template"]}
    view = JobView(job)
    model = DistributedTrainingJobSpec.model_validate(job["spec"])
    assert view.spec_errors == []
    assert (view.master_port, view.metrics_port) == (model.master_port, model.metrics_port) == (29500, 9400)
    assert view.min_replicas == view.replicas == view.desired_replicas == 3
    assert (view.max_restarts, view.scheduling_timeout_seconds) == (3, 60.0)
    assert (view.restart_policy, view.clean_pod_policy) == ("ExitCode", "Running")
    assert [c for c in range(256) if view.is_permanent_exit_code(c)] == [2, 126, 127]
    assert view.checkpoint_volume is None and view.checkpoint_mount_path == "/checkpoints"


def test_jobview_of_an_invalid_spec_names_the_fields_instead_of_raising_on_identity() -> None:
    job = make_job(replicas=0)
    view = JobView(job)
    assert (view.name, view.namespace, view.uid) == ("gpt", "ml", "uid-1")
    assert any(e.startswith("spec.replicas:") for e in view.spec_errors)
    with pytest.raises(InvalidJobError, match=r"spec\.replicas"):
        _ = view.master_port


def test_integer_quantities_of_the_template_reach_the_pod_as_strings() -> None:
    # `nvidia.com/gpu: 1` as YAML writes it: the Kubernetes client refuses a pod with an int there
    job = make_job()
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["resources"] = {"requests": {"cpu": 1, "nvidia.com/gpu": 1}, "limits": {"nvidia.com/gpu": 1}}
    pod = worker_pod(JobView(job), 0, 4, 0, WorkerDefaults())
    resources = pod["spec"]["containers"][0]["resources"]
    assert resources == {"requests": {"cpu": "1", "nvidia.com/gpu": "1"}, "limits": {"nvidia.com/gpu": "1"}}
    assert job["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] == {"nvidia.com/gpu": 1}


def test_avoided_nodes_are_anded_into_every_term_of_the_templates_node_affinity() -> None:
    job = make_job()
    gpu = {"key": "gpu", "operator": "In", "values": ["h200"]}
    zone = {"key": "zone", "operator": "In", "values": ["a"]}
    required = {"nodeSelectorTerms": [{"matchExpressions": [gpu]}, {"matchExpressions": [zone]}]}
    job["spec"]["template"]["spec"]["affinity"] = {
        "nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": required}
    }
    pod = worker_pod(JobView(job), 0, 2, 1, WorkerDefaults(), avoid_nodes=["n1", "n3"])
    # One requirement per node: a field selector's NotIn takes one value (the API server refuses more).
    avoid = [{"key": "metadata.name", "operator": "NotIn", "values": [n]} for n in ("n1", "n3")]
    terms = pod["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert terms["nodeSelectorTerms"] == [
        {"matchExpressions": [gpu], "matchFields": avoid},
        {"matchExpressions": [zone], "matchFields": avoid},
    ]
    plain = worker_pod(JobView(make_job()), 0, 2, 1, WorkerDefaults(), avoid_nodes=["n1", "n3"])
    fits = {n: node_admits(plain, make_node(n)) for n in ("n1", "n2", "n3")}
    assert fits == {"n1": False, "n2": True, "n3": False}
    assert "affinity" not in worker_pod(JobView(make_job()), 0, 2, 1, WorkerDefaults())["spec"]


def test_the_trainer_falls_back_to_its_log_for_a_termination_message_unless_the_template_says() -> None:
    pod = worker_pod(JobView(make_job()), rank=0, world_size=2, generation=0, defaults=WorkerDefaults())
    assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "FallbackToLogsOnError"
    job = make_job()
    job["spec"]["template"]["spec"]["containers"][0]["terminationMessagePolicy"] = "File"
    pod = worker_pod(JobView(job), rank=0, world_size=2, generation=0, defaults=WorkerDefaults())
    assert pod["spec"]["containers"][0]["terminationMessagePolicy"] == "File"

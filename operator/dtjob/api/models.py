"""The DistributedTrainingJob API (training.dtjob.io/v1alpha1) as pydantic models.

These models are the single source of truth: the CRD (`dtjob crd`), its `kubectl explain` text,
defaults, CEL rules and the README's field table are all generated from them. Python attribute
names are snake_case; the YAML/JSON names are the camelCase aliases (`min_replicas` is
`minReplicas`). `spec.template` and `spec.checkpoint.volume` are plain dicts in Python and are
validated by the API server against Kubernetes' own PodTemplateSpec / VolumeSource schemas.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.alias_generators import to_camel

GROUP = "training.dtjob.io"
VERSION = "v1alpha1"
API_VERSION: Final = "training.dtjob.io/v1alpha1"
KIND: Final = "DistributedTrainingJob"
PLURAL = "distributedtrainingjobs"
SINGULAR = "distributedtrainingjob"
SHORT_NAME = "dtj"
TRAINER_CONTAINER = "trainer"
DEFAULT_MASTER_PORT = 29500  # torchrun's default rendezvous port
DEFAULT_METRICS_PORT = 9400

# Marker the CRD generator replaces with the vendored Kubernetes schema of that name.
K8S_SCHEMA_KEY = "x-dtjob-k8s-schema"
PodTemplateSpec = Annotated[dict[str, Any], WithJsonSchema({K8S_SCHEMA_KEY: "PodTemplateSpec"})]
VolumeSource = Annotated[dict[str, Any], WithJsonSchema({K8S_SCHEMA_KEY: "VolumeSource"})]


class ApiModel(BaseModel):
    """camelCase on the wire, snake_case in Python; unknown fields are errors, like the CRD."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid")

    def to_dict(self) -> dict[str, Any]:
        """The Kubernetes form: camelCase keys, unset optional fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


class RestartPolicy(StrEnum):
    """What a failed worker (non-zero exit other than 75, the planned stop) does to the job."""

    ON_FAILURE = "OnFailure"
    EXIT_CODE = "ExitCode"
    NEVER = "Never"


class CleanPodPolicy(StrEnum):
    """Which worker pods are deleted when the job finishes (as in Kubeflow's run policy)."""

    NONE = "None"
    RUNNING = "Running"
    ALL = "All"


class JobPhase(StrEnum):
    """The job's lifecycle phase, written by the operator to status.phase."""

    PENDING = "Pending"
    RUNNING = "Running"
    RESTARTING = "Restarting"
    SUSPENDED = "Suspended"
    SUCCEEDED = "Succeeded"
    FAILED = "Failed"


class ElasticPolicy(ApiModel):
    """Elastic bounds of the world size and what a worker failure does."""

    min_replicas: int | None = Field(
        default=None,
        ge=1,
        description="Smallest world size the job may shrink to when workers or nodes are lost. "
        "Unset: spec.replicas (the job never shrinks). Must be <= spec.replicas.",
    )
    max_replicas: int | None = Field(
        default=None,
        ge=1,
        description="Largest world size `kubectl scale` may ask for. Unset: no upper bound. "
        "Must be >= spec.replicas.",
    )
    max_restarts: int = Field(
        default=3,
        ge=0,
        description="Gang restarts after worker failures before the job is marked Failed. Planned "
        "rescales and suspends do not count; node loss does.",
    )
    unschedulable_timeout_seconds: int = Field(
        default=60,
        ge=1,
        description="How long new workers may stay unschedulable before the job shrinks to the "
        "workers that fit (never below minReplicas).",
    )
    restart_policy: RestartPolicy = Field(
        default=RestartPolicy.EXIT_CODE,
        description="On a worker failure: OnFailure restarts the gang; Never fails the job; "
        "ExitCode fails the job at once when the exit code is in permanentExitCodes and "
        "restarts the gang otherwise.",
    )
    heartbeat_timeout_seconds: int = Field(
        default=10,
        ge=1,
        le=3600,
        description="A rank whose heartbeat (every eighth of this, at most a second apart, "
        "through the rendezvous store) is silent this long is lost: the other ranks exit 76 "
        "naming it, and the gang restarts (counted), without waiting for a collective timeout "
        "or the node to turn NotReady. "
        "Given to the trainer as DTJOB_HEARTBEAT_TIMEOUT. The other liveness timeouts in the pods "
        "(the agents' of restarts in place) are multiples of it: docs/design.md.",
    )
    progress_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="A running gang whose step (rank 0's dtjob_trainer_step) does not advance "
        "for this long is restarted (counted), whatever the trainer does. Unset: off. Needs a "
        "trainer that publishes the step; condition MetricsAvailable says when it does not.",
    )
    restart_in_place: bool | None = Field(
        default=None,
        description="Restart the gang inside its running pods when a trainer process fails: the "
        "pods run under dtjob's agent (`python -m dtjob.launcher`), which kills every pod's "
        "trainers and starts them again from a warm standby process that imported torch "
        "beforehand (a second Python process per trainer, idle until needed); the gang resumes "
        "from its newest checkpoint, counted in status.restarts like any restart. A pod or node "
        "that is lost, a permanent exit code, or a pod whose agent does not answer still restart "
        "the gang in new pods. Needs dtjob in the image. Unset: on when the trainer container's "
        "command is `python -m dtjob.trainer`, off otherwise, also with no command (the "
        "image's ENTRYPOINT, which the operator cannot read). True with no command runs "
        "`python -m dtjob.trainer` (the trainer image's ENTRYPOINT) under the agent. Condition "
        "RestartInPlace says which applies and why. The agent listens on masterPort + 1.",
    )
    permanent_exit_codes: list[Annotated[int, Field(ge=1, le=255)]] = Field(
        default_factory=lambda: [2, 126, 127],
        max_length=64,
        description="Exit codes that are permanent errors under restartPolicy ExitCode (2: the "
        "trainer rejected its flags; 126/127: command not executable / not found).",
        json_schema_extra={"default": [2, 126, 127]},
    )


class CheckpointSpec(ApiModel):
    """Storage shared by all workers, from which every new generation resumes."""

    volume: VolumeSource = Field(
        description="Where checkpoints live: a Kubernetes volume source (persistentVolumeClaim, "
        "hostPath, nfs, ...) that every worker can reach. Workers resume from its newest "
        "complete checkpoint at whatever world size the new generation has.",
    )
    mount_path: str = Field(
        default="/checkpoints",
        pattern=r"^/",
        description="Absolute path at which the volume is mounted in the trainer container; "
        "given to the trainer as DTJOB_CHECKPOINT_DIR.",
    )


class SchedulingPolicy(ApiModel):
    """How the worker pods are scheduled: scheduler, Volcano queue, priority, gang."""

    scheduler_name: str | None = Field(
        default=None,
        description="schedulerName of the worker pods. `volcano` also creates a Volcano PodGroup "
        "for the gang. Unset: the template's schedulerName or the cluster default.",
    )
    queue: str | None = Field(
        default=None, description="Volcano queue of the job's PodGroup. Needs gang or schedulerName volcano."
    )
    priority_class_name: str | None = Field(
        default=None, description="PriorityClass of the worker pods and of the PodGroup."
    )
    gang: bool = Field(
        default=False,
        description="Schedule all workers of a generation together or none (a Volcano PodGroup "
        "with minMember = the generation's world size).",
    )


class RunPolicy(ApiModel):
    """Deadline, clean-up after the end, and suspension."""

    active_deadline_seconds: int | None = Field(
        default=None,
        ge=1,
        description="Seconds the job may run (since startTime) before it is failed with reason "
        "DeadlineExceeded. Unset: no limit.",
    )
    ttl_seconds_after_finished: int | None = Field(
        default=None,
        ge=0,
        description="Seconds after Succeeded or Failed before the job and its children are "
        "deleted. Unset: kept.",
    )
    clean_pod_policy: CleanPodPolicy = Field(
        default=CleanPodPolicy.RUNNING,
        description="Which worker pods to delete when the job finishes: None, Running (those "
        "still running; finished pods stay for their logs) or All.",
    )
    suspend: bool = Field(
        default=False,
        description="True: workers checkpoint and stop, and the job waits as Suspended; false "
        "again resumes from that checkpoint.",
    )


class Parallelism(ApiModel):
    """How the processes of one data-parallel replica split the model (3-D parallelism, #44)."""

    tensor: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Tensor-parallel size T: each layer is split over T processes of one pod (its "
        "NVLink), so T must divide nprocPerWorker. Given to the trainer as "
        "DTJOB_PARALLELISM_TENSOR (the built-in trainer's --tensor-parallel).",
    )
    pipeline: int = Field(
        default=1,
        ge=1,
        le=1024,
        description="Pipeline stages P of one replica, across pods. Given to the trainer as "
        "DTJOB_PARALLELISM_PIPELINE (the built-in trainer's --pipeline-stages, with --strategy "
        "pipeline).",
    )


class DistributedTrainingJobSpec(ApiModel):
    """The desired state of a job; the user writes it."""

    replicas: int = Field(
        ge=1,
        description="Desired world size: the number of worker pods. `kubectl scale` sets it "
        "within [elastic.minReplicas, elastic.maxReplicas].",
    )
    elastic: ElasticPolicy = Field(
        default_factory=lambda: ElasticPolicy(),
        description="Elastic bounds and failure handling.",
        json_schema_extra={"default": {}},
    )
    checkpoint: CheckpointSpec | None = Field(
        default=None,
        description="Shared checkpoint storage. Unset: every new generation starts from step 0. Immutable. "
        "One job writes a directory at a time: a job whose volume (the same claim, or the same "
        "server and path, normalised, one inside the other included) another live job of the "
        "namespace uses does not start (condition Waiting, reason CheckpointDirInUse) until that "
        "job finishes or is deleted. The job that started first owns it, else the older.",
    )
    scheduling: SchedulingPolicy = Field(
        default_factory=lambda: SchedulingPolicy(),
        description="Scheduler, Volcano queue, priority and gang scheduling.",
        json_schema_extra={"default": {}},
    )
    run_policy: RunPolicy = Field(
        default_factory=lambda: RunPolicy(),
        description="Deadline, clean-up and suspension.",
        json_schema_extra={"default": {}},
    )
    master_port: int = Field(
        default=DEFAULT_MASTER_PORT,
        ge=1,
        le=65534,
        description="Rendezvous port on rank 0 (MASTER_PORT). masterPort + 1 is the pod agent's "
        "(elastic.restartInPlace). Immutable.",
    )
    metrics_port: int = Field(
        default=DEFAULT_METRICS_PORT,
        ge=1,
        le=65535,
        description="Port of each worker's Prometheus endpoint (DTJOB_METRICS_PORT), which the "
        "operator reads step and checkpoint progress from.",
    )
    nproc_per_worker: int | None = Field(
        default=None,
        ge=1,
        le=64,
        description="Trainer processes per worker pod (LOCAL_WORLD_SIZE; torchrun's --nproc-per-node). "
        "Unset: the trainer container's nvidia.com/gpu limit, else 1. With more than one, the pod runs "
        "the container's command through `python -m dtjob.launcher`. Replicas, elastic bounds and "
        "`kubectl scale` count pods; the gang has replicas x nprocPerWorker processes. Immutable.",
    )
    parallelism: Parallelism | None = Field(
        default=None,
        description="Tensor and pipeline parallelism of the trainer: the data-parallel size is "
        "replicas x nprocPerWorker / (tensor x pipeline), and elastic rescales and `kubectl scale` "
        "change it only. With tensor x pipeline > 1, nprocPerWorker must be set, and every world "
        "size from elastic.minReplicas to elastic.maxReplicas (unset: replicas) must be a "
        "multiple of tensor x pipeline. Unset: the trainer's flags decide (no variables set). "
        "Change it with a new job (the trainer refuses a checkpoint of another tensor size).",
    )
    template: PodTemplateSpec = Field(
        description="Pod template of every worker; it must have a container named `trainer`, "
        "and a restartPolicy of Never if any (the operator restarts the gang). Immutable.",
    )

    @property
    def min_world_size(self) -> int:
        """The smallest world size the job may run at: elastic.minReplicas, else replicas."""
        return self.elastic.min_replicas or self.replicas

    def trainer_container(self) -> dict[str, Any] | None:
        """The template's container named `trainer`, if there is one."""
        containers = (self.template.get("spec") or {}).get("containers") or []
        named = (c for c in containers if isinstance(c, dict) and c.get("name") == TRAINER_CONTAINER)
        return next(named, None)


class Condition(ApiModel):
    """One observation of the job's state, in the usual Kubernetes condition shape."""

    type: str = Field(
        description="Condition type: Created, Running, Restarting, Suspended, Succeeded, Failed "
        "(the phases); Valid (the spec passes every rule), Schedulable (the workers fit), "
        "MetricsAvailable (what the trainer publishes), CheckpointWriteFailing (rank 0's periodic "
        "checkpoints refused by the volume), Waiting (what the operator waits for), "
        "Reconciled (the operator's last pass went through)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str | None = Field(default=None, description="One-word CamelCase reason for the last transition.")
    message: str | None = Field(default=None, description="Human-readable details of the last transition.")
    last_transition_time: datetime | None = Field(
        default=None, description="When the status of this condition last changed."
    )
    last_update_time: datetime | None = Field(
        default=None, description="When this condition was last updated."
    )


class CheckpointStatus(ApiModel):
    """The newest complete checkpoint the workers reported."""

    step: int = Field(ge=0, description="Training step the checkpoint holds.")
    time: datetime | None = Field(default=None, description="When the checkpoint was completed.")


class SilentNode(ApiModel):
    """A node whose kubelet did not finish a worker's deletion in time, or that ran a lost rank."""

    name: str = Field(description="The node's name.")
    since: datetime = Field(description="When the operator found it silent or suspected it.")
    lease_renew_time: str | None = Field(
        default=None,
        description=(
            "spec.renewTime of the node's Lease in kube-node-lease when it was found silent (unset: "
            "not readable); a different one later means its kubelet is alive, and the node is "
            "trusted again."
        ),
    )


class JobProgress(ApiModel):
    """How far training is, from rank 0's metrics (fields it does not publish stay unset)."""

    step: int | None = Field(default=None, ge=0, description="Latest training step reported by rank 0.")
    total_steps: int | None = Field(
        default=None, ge=0, description="Steps of the whole run (dtjob_trainer_total_steps)."
    )
    tokens_per_second: float | None = Field(
        default=None,
        description="Global tokens per second of rank 0's last step (dtjob_trainer_tokens_per_second).",
    )
    model_flops_utilization: float | None = Field(
        default=None,
        description="MFU of rank 0's last step, 0..1 (dtjob_trainer_model_flops_utilization; unset: "
        "unknown).",
    )
    steps_per_second: float | None = Field(
        default=None,
        description="Recent step rate of the current gang: a moving average over the operator's "
        "samples of the step, the rate status.eta extrapolates (unset: not known yet).",
    )


class GoodputSample(ApiModel):
    """The operator's last sample of the step (the goodput's bookkeeping)."""

    time: datetime = Field(description="When it was taken.")
    step: int = Field(ge=0, description="Rank 0's step.")
    gang: str = Field(description="The gang that reported it: generation.restartsInPlace.")


class Goodput(ApiModel):
    """The share of the job's wall time that went into steps that were kept."""

    ratio: float = Field(
        ge=0,
        le=1,
        description="keptSeconds over the wall time since the job started (at its last sample, "
        "or its completion).",
    )
    kept_seconds: float = Field(
        ge=0,
        description="Seconds between two samples of the step by the same gang, shared among the "
        "steps done in between; a step whose number was reached before (redone after a rewind "
        "to a checkpoint) does not count, nor does time without a gang stepping.",
    )
    steps_redone: int = Field(ge=0, description="Steps done again after a rewind to a checkpoint.")
    highest_step: int = Field(ge=0, description="The highest step reached.")
    since: datetime = Field(description="When the job started (its wall time counts from here).")
    sample: GoodputSample | None = Field(default=None, description="The last sample of the step.")


class Recovery(ApiModel):
    """One stop and restart of the gang, and what it cost."""

    cause: str = Field(
        description="ExitCode, Signal (an exit code above 128), Hang (a stalled step or a silent "
        "rank), NodeLost, PlannedRescale, Preemption or PodDeleted."
    )
    reason: str = Field(
        description="The operator's reason (as on the Restarting condition), InPlace for a restart in place."
    )
    detected_at: datetime = Field(description="When the operator decided the restart.")
    detection_seconds: float = Field(
        ge=0,
        description="From the failure (the container's exit, the node's NotReady, the last step "
        "of a hang) to detectedAt; 0 for a planned restart and where the failure time is unknown.",
    )
    downtime_seconds: float | None = Field(
        default=None,
        ge=0,
        description="From the failure to the next gang's step being seen moving (or the next "
        "failure, or the job's end); unset while the gang has not stepped since.",
    )
    steps_redone: int = Field(
        ge=0,
        description="Steps past the newest checkpoint when it was detected, which the next gang "
        "redoes (0 for a planned restart: the gang checkpoints first).",
    )
    world_size_before: int = Field(ge=0, description="Workers before.")
    world_size_after: int = Field(ge=0, description="Workers after.")


class DistributedTrainingJobStatus(ApiModel):
    """The observed state of a job; only the operator writes it."""

    phase: JobPhase | None = Field(
        default=None, description="Pending, Running, Restarting, Suspended, Succeeded or Failed."
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Latest observations of the job's state, one per type."
    )
    replicas: int | None = Field(
        default=None, ge=0, description="World size of the current generation (number of workers)."
    )
    world_size: int | None = Field(
        default=None,
        ge=0,
        description="Trainer processes in the current generation: replicas x nprocPerWorker.",
    )
    ready_replicas: int | None = Field(default=None, ge=0, description="Workers of this generation running.")
    selector: str | None = Field(
        default=None, description="Label selector of the worker pods (for the scale subresource)."
    )
    generation: int | None = Field(
        default=None,
        ge=0,
        description="Gang generation number: 0 for the first gang, +1 at each restart or rescale.",
    )
    restarts: int | None = Field(
        default=None,
        ge=0,
        description="Gang restarts caused by failures, in new pods and in place, counted against "
        "maxRestarts.",
    )
    in_place_restarts: int | None = Field(
        default=None,
        ge=0,
        description="Restarts in place of the current generation (elastic.restartInPlace) the "
        "operator has counted: from rank 0's metrics, or the pod agent's last log line.",
    )
    step: int | None = Field(default=None, ge=0, description="Latest training step reported by rank 0.")
    last_checkpoint: CheckpointStatus | None = Field(default=None, description="Newest complete checkpoint.")
    last_progress_time: datetime | None = Field(
        default=None, description="When status.step last changed (elastic.progressDeadlineSeconds)."
    )
    observed_generation: int | None = Field(
        default=None, description="metadata.generation of the spec the operator last acted on."
    )
    start_time: datetime | None = Field(default=None, description="When the first worker started.")
    silent_nodes: list[SilentNode] | None = Field(
        default=None,
        description=(
            "Nodes still Ready whose kubelet left a worker's deletion unfinished past its grace "
            "period (a node gone silent before it turns NotReady), or that ran a rank its peers "
            "declared lost (no heartbeat): the worker was force-deleted, "
            "and new workers avoid these nodes for 120 s, or until the node turns NotReady, is Ready "
            "again after a transition, or renews its Lease."
        ),
    )
    completion_time: datetime | None = Field(default=None, description="When the job succeeded or failed.")
    progress: JobProgress | None = Field(
        default=None, description="How far training is, from rank 0's metrics."
    )
    eta: datetime | None = Field(
        default=None,
        description="When the job reaches progress.totalSteps at progress.stepsPerSecond (unset: "
        "either is not known, or the gang is restarting).",
    )
    goodput: Goodput | None = Field(
        default=None, description="The share of the job's wall time that went into kept steps."
    )
    recoveries: list[Recovery] | None = Field(
        default=None, description="The newest 10 recoveries of the gang, oldest first."
    )


class DistributedTrainingJob(ApiModel):
    """DistributedTrainingJob runs a gang of PyTorch workers (DDP, FSDP or pipeline parallel)
    that restarts elastically within [elastic.minReplicas, elastic.maxReplicas] when workers or
    nodes are lost, resuming from the newest checkpoint."""

    model_config = ConfigDict(extra="ignore")

    api_version: Literal["training.dtjob.io/v1alpha1"] = Field(
        default=API_VERSION, description="training.dtjob.io/v1alpha1"
    )
    kind: Literal["DistributedTrainingJob"] = Field(default=KIND, description="DistributedTrainingJob")
    metadata: dict[str, Any] = Field(default_factory=dict, description="Standard object metadata.")
    spec: DistributedTrainingJobSpec = Field(
        description="Desired state: world size, elastic bounds, checkpoint storage, scheduling, "
        "run policy and the worker pod template."
    )
    status: DistributedTrainingJobStatus = Field(
        default_factory=lambda: DistributedTrainingJobStatus(),
        description="Observed state, written by the operator.",
    )

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", ""))

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace", "default"))

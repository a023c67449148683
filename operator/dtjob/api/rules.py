"""Cross-field rules of a DistributedTrainingJob, once for the API server (CEL) and once in Python.

Each rule carries its CEL expression (emitted into the CRD as an `x-kubernetes-validations`
entry on `spec`, where `self` is the spec) and the same check in Python, so the operator can
validate again: an API server without CEL, or an object written before the CRD was updated,
cannot get a bad job past it. The messages are shared, and both name the offending field.

Immutable fields (transition rules, checked on update only):
- `masterPort`: it is baked into the running workers' MASTER_PORT; a gang whose members disagree
  on the rendezvous port never forms.
- `checkpoint`: the job's training state lives there; switching storage mid-job would silently
  restart from step 0 or resume a different run.
- `template`: the running gang was created from it; an elastic restart would mix pods of two
  templates in one process group, and new code may not load the old checkpoints. As with
  batch/v1 Job, change the template by creating a new job.
- `parallelism`: the checkpoint's split parameters are stored per tensor-parallel rank and its
  pipeline stages per stage; another tensor or pipeline size cannot load them. Delete and
  recreate the job, converting the checkpoint through full_state_dict.
Everything else may change while a job runs: `replicas` (a planned rescale), the elastic bounds,
the scheduling policy (used by the next generation) and the run policy (`suspend`).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from dtjob.api.models import TRAINER_CONTAINER, DistributedTrainingJob, DistributedTrainingJobSpec


@dataclass(frozen=True)
class Rule:
    """`field` is the path under spec the error is reported on (as `spec.<field>`)."""

    field: str
    cel: str
    message: str
    ok: Callable[[DistributedTrainingJobSpec], bool]


@dataclass(frozen=True)
class TransitionRule:
    """A rule over the new and the old spec (`self`, `oldSelf`), checked on update."""

    field: str
    cel: str
    message: str
    ok: Callable[[DistributedTrainingJobSpec, DistributedTrainingJobSpec], bool]
    why: str  # for the README


def _pod_spec(spec: DistributedTrainingJobSpec) -> dict[str, Any]:
    pod_spec = spec.template.get("spec")
    return pod_spec if isinstance(pod_spec, dict) else {}


def _tp(spec: DistributedTrainingJobSpec) -> tuple[int, int]:
    """(tensor, pipeline) of spec.parallelism, (1, 1) without it."""
    p = spec.parallelism
    return (1, 1) if p is None else (p.tensor, p.pipeline)


def _world_sizes_fit(spec: DistributedTrainingJobSpec) -> bool:
    """Every world size the bounds allow, replicas x nprocPerWorker for replicas from
    elastic.minReplicas to elastic.maxReplicas (each unset: replicas), holds whole T x P replicas."""
    tensor, pipeline = _tp(spec)
    if spec.nproc_per_worker is None:
        return True  # the rule above asks for it
    n, low, high = spec.nproc_per_worker, *_bounds(spec)
    # One size: r x n. Two or more consecutive ones: their difference n must be a multiple too,
    # and then all are (the CEL rule says the same).
    return (low * n if low == high else n) % (tensor * pipeline) == 0


def _bounds(spec: DistributedTrainingJobSpec) -> tuple[int, int]:
    return spec.elastic.min_replicas or spec.replicas, spec.elastic.max_replicas or spec.replicas


# CEL: T and P (defaults 1) and the bounds, as _tp and _bounds.
_T = "(has(self.parallelism.tensor) ? self.parallelism.tensor : 1)"
_P = "(has(self.parallelism.pipeline) ? self.parallelism.pipeline : 1)"
_LOW = "(has(self.elastic) && has(self.elastic.minReplicas) ? self.elastic.minReplicas : self.replicas)"
_HIGH = "(has(self.elastic) && has(self.elastic.maxReplicas) ? self.elastic.maxReplicas : self.replicas)"


def _sizes(spec: str) -> str:
    """CEL: [tensor, pipeline] of `spec` (self or oldSelf), 1 where unset, as _tp gives them."""
    sizes = [
        f"(has({spec}.parallelism) && has({spec}.parallelism.{f}) ? {spec}.parallelism.{f} : 1)"
        for f in ("tensor", "pipeline")
    ]
    return "[" + ", ".join(sizes) + "]"


RULES: tuple[Rule, ...] = (
    Rule(
        "replicas",
        "!has(self.elastic) || !has(self.elastic.minReplicas) || self.replicas >= self.elastic.minReplicas",
        "replicas must be >= elastic.minReplicas",
        lambda s: s.elastic.min_replicas is None or s.replicas >= s.elastic.min_replicas,
    ),
    Rule(
        "replicas",
        "!has(self.elastic) || !has(self.elastic.maxReplicas) || self.replicas <= self.elastic.maxReplicas",
        "replicas must be <= elastic.maxReplicas",
        lambda s: s.elastic.max_replicas is None or s.replicas <= s.elastic.max_replicas,
    ),
    Rule(
        "elastic.maxReplicas",
        "!has(self.elastic) || !has(self.elastic.minReplicas) || !has(self.elastic.maxReplicas)"
        " || self.elastic.minReplicas <= self.elastic.maxReplicas",
        "elastic.maxReplicas must be >= elastic.minReplicas",
        lambda s: (
            s.elastic.min_replicas is None
            or s.elastic.max_replicas is None
            or s.elastic.min_replicas <= s.elastic.max_replicas
        ),
    ),
    Rule(
        "template.spec.containers",
        "has(self.template.spec)"
        f" && self.template.spec.containers.exists(c, c.name == '{TRAINER_CONTAINER}')",
        f"template.spec.containers must include a container named '{TRAINER_CONTAINER}'",
        lambda s: s.trainer_container() is not None,
    ),
    Rule(
        "template.spec.restartPolicy",
        "!has(self.template.spec) || !has(self.template.spec.restartPolicy)"
        " || self.template.spec.restartPolicy == 'Never'",
        "template.spec.restartPolicy must be Never (the operator restarts the whole gang)",
        lambda s: _pod_spec(s).get("restartPolicy", "Never") == "Never",
    ),
    Rule(
        "metricsPort",
        "self.metricsPort != self.masterPort",
        "metricsPort must differ from masterPort",
        lambda s: s.metrics_port != s.master_port,
    ),
    Rule(
        "metricsPort",
        "self.metricsPort != self.masterPort + 1",
        "metricsPort must differ from masterPort + 1 (the pod agent's port)",
        lambda s: s.metrics_port != s.master_port + 1,
    ),
    Rule(
        "parallelism",
        f"!has(self.parallelism) || {_T} * {_P} == 1 || has(self.nprocPerWorker)",
        "parallelism with tensor x pipeline > 1 needs nprocPerWorker set (a tensor-parallel group is "
        "the processes of one pod)",
        lambda s: _tp(s) == (1, 1) or s.nproc_per_worker is not None,
    ),
    Rule(
        "parallelism.tensor",
        f"!has(self.parallelism) || !has(self.nprocPerWorker) || self.nprocPerWorker % {_T} == 0",
        "parallelism.tensor must divide nprocPerWorker (a tensor-parallel group stays inside one pod); "
        "use a divisor or raise nprocPerWorker",
        lambda s: s.nproc_per_worker is None or s.nproc_per_worker % _tp(s)[0] == 0,
    ),
    Rule(
        "parallelism",
        f"!has(self.parallelism) || !has(self.nprocPerWorker) || ({_LOW} == {_HIGH} ? "
        f"{_LOW} * self.nprocPerWorker % ({_T} * {_P}) == 0 : self.nprocPerWorker % ({_T} * {_P}) == 0)",
        "every world size replicas x nprocPerWorker from elastic.minReplicas to elastic.maxReplicas "
        "(unset: replicas) must be a multiple of parallelism.tensor x parallelism.pipeline; change "
        "the bounds, nprocPerWorker or parallelism",
        _world_sizes_fit,
    ),
    Rule(
        "scheduling.queue",
        "!has(self.scheduling) || !has(self.scheduling.queue) || self.scheduling.gang"
        " || (has(self.scheduling.schedulerName) && self.scheduling.schedulerName == 'volcano')",
        "scheduling.queue needs scheduling.gang: true or scheduling.schedulerName: volcano",
        lambda s: s.scheduling.queue is None or s.scheduling.gang or s.scheduling.scheduler_name == "volcano",
    ),
)

TRANSITION_RULES: tuple[TransitionRule, ...] = (
    TransitionRule(
        "masterPort",
        "self.masterPort == oldSelf.masterPort",
        "masterPort is immutable",
        lambda new, old: new.master_port == old.master_port,
        "running workers have it as MASTER_PORT; a gang that disagrees on it never forms",
    ),
    TransitionRule(
        "checkpoint",
        "has(self.checkpoint) == has(oldSelf.checkpoint)"
        " && (!has(self.checkpoint) || self.checkpoint == oldSelf.checkpoint)",
        "checkpoint is immutable",
        lambda new, old: new.checkpoint == old.checkpoint,
        "the training state lives there; new storage would silently restart from step 0",
    ),
    TransitionRule(
        "template",
        "self.template == oldSelf.template",
        "template is immutable (create a new job to change it)",
        lambda new, old: new.template == old.template,
        "an elastic restart would mix pods of two templates in one gang (as with batch/v1 Job)",
    ),
    TransitionRule(
        "parallelism",
        f"{_sizes('self')} == {_sizes('oldSelf')}",
        "parallelism is immutable: the checkpoint is split by it; delete and recreate the job, "
        "converting the checkpoint with full_state_dict",
        lambda new, old: _tp(new) == _tp(old),
        "the checkpoint holds each parameter per tensor-parallel rank and per pipeline stage; "
        "another size cannot load it",
    ),
)


# Worker pod names are `<job>-worker-<rank>` and double as hostnames (DNS labels, <= 63
# characters): 63 - len("-worker-") - 5 rank digits = 50. The job name is also the headless
# Service's name, so it must be a DNS-1035 label (no dots, starts with a letter).
MAX_JOB_NAME_LENGTH = 50
JOB_NAME_PATTERN = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
NAME_MESSAGE = (
    f"metadata.name must be a DNS-1035 label of at most {MAX_JOB_NAME_LENGTH} characters "
    "(it names the Service and the `<name>-worker-<rank>` hostnames)"
)
NAME_CEL = (
    "!has(self.metadata.name) || (size(self.metadata.name) <= "
    f"{MAX_JOB_NAME_LENGTH} && self.metadata.name.matches('{JOB_NAME_PATTERN}'))"
)


def name_ok(name: str) -> bool:
    return len(name) <= MAX_JOB_NAME_LENGTH and re.fullmatch(JOB_NAME_PATTERN, name) is not None


def cel_validations() -> list[dict[str, str]]:
    """The `x-kubernetes-validations` of the CRD's spec schema."""
    rules: list[Rule | TransitionRule] = [*RULES, *TRANSITION_RULES]
    return [
        {"rule": r.cel, "message": r.message, "fieldPath": f".{r.field}", "reason": "FieldValueInvalid"}
        for r in rules
    ]


class InvalidJobError(ValueError):
    """A manifest that is not a valid DistributedTrainingJob; `errors` name the fields."""

    def __init__(self, errors: list[str]) -> None:
        super().__init__("invalid DistributedTrainingJob: " + "; ".join(errors))
        self.errors = errors


def _pydantic_messages(error: ValidationError) -> list[str]:
    messages = []
    for e in error.errors():
        path = ".".join(str(part) for part in e["loc"])
        messages.append(f"{path}: {e['msg']}")
    return messages


def parse_job(obj: dict[str, Any]) -> DistributedTrainingJob:
    """The object as a model (defaults filled in); InvalidJobError names each bad field."""
    try:
        return DistributedTrainingJob.model_validate(obj)
    except ValidationError as error:
        raise InvalidJobError(_pydantic_messages(error)) from None


def validate_job(
    job: dict[str, Any] | DistributedTrainingJob,
    old: dict[str, Any] | DistributedTrainingJob | None = None,
) -> list[str]:
    """Every problem of `job` (and of the update from `old`, if given): `spec.<field>: message`."""
    try:
        new = job if isinstance(job, DistributedTrainingJob) else parse_job(job)
    except InvalidJobError as error:
        return error.errors
    problems = [f"spec.{r.field}: {r.message}" for r in RULES if not r.ok(new.spec)]
    if "name" in new.metadata and not name_ok(new.name):
        problems.insert(0, f"metadata.name: {NAME_MESSAGE}")
    if old is not None:
        try:
            previous = old if isinstance(old, DistributedTrainingJob) else parse_job(old)
        except InvalidJobError:
            return problems  # the old object is not ours to judge; nothing to compare with
        problems += [
            f"spec.{r.field}: {r.message}" for r in TRANSITION_RULES if not r.ok(new.spec, previous.spec)
        ]
    return problems

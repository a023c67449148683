"""The DistributedTrainingJob API (training.dtjob.io/v1alpha1): models, rules and the CRD generator.

The operator checks every job with `validate_job` (the CRD's rules, in Python), which reads the
object through `parse_job` (object -> model); the operator's JobView parses the spec itself.
"""

from dtjob.api.models import (
    API_VERSION,
    GROUP,
    KIND,
    PLURAL,
    SHORT_NAME,
    TRAINER_CONTAINER,
    VERSION,
    CheckpointSpec,
    CheckpointStatus,
    CleanPodPolicy,
    Condition,
    DistributedTrainingJob,
    DistributedTrainingJobSpec,
    DistributedTrainingJobStatus,
    ElasticPolicy,
    JobPhase,
    RestartPolicy,
    RunPolicy,
    SchedulingPolicy,
)
from dtjob.api.rules import InvalidJobError, parse_job, validate_job

__all__ = [
    "API_VERSION",
    "GROUP",
    "KIND",
    "PLURAL",
    "SHORT_NAME",
    "TRAINER_CONTAINER",
    "VERSION",
    "CheckpointSpec",
    "CheckpointStatus",
    "CleanPodPolicy",
    "Condition",
    "DistributedTrainingJob",
    "DistributedTrainingJobSpec",
    "DistributedTrainingJobStatus",
    "ElasticPolicy",
    "InvalidJobError",
    "JobPhase",
    "RestartPolicy",
    "RunPolicy",
    "SchedulingPolicy",
    "parse_job",
    "validate_job",
]

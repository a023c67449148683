"""spec.parallelism (#44) from the API to the trainer's flags: the rules, the pod variables the
operator sets, and the built-in trainer's checks of --tensor-parallel against them."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from dtjob import contract
from dtjob.api import parse_job, validate_job
from dtjob.operator.jobview import JobView
from dtjob.operator.manifests import worker_pod
from dtjob.operator.worker_defaults import WorkerDefaults
from dtjob.trainer.config import ConfigError, parse
from tests.unit.reconciler_fixtures import env_of, make_job
from tests.unit.test_api_validation import base_job

WORLD_SIZES_MESSAGE = "every world size replicas x nprocPerWorker from elastic.minReplicas"


def _job(replicas: int, low: int | None, high: int | None, nproc: int, tensor: int, pipeline: int) -> Any:
    job = base_job()
    elastic = {"minReplicas": low, "maxReplicas": high}
    job["spec"].update(
        replicas=replicas,
        elastic={k: v for k, v in elastic.items() if v is not None},
        nprocPerWorker=nproc,
        parallelism={"tensor": tensor, "pipeline": pipeline},
    )
    return job


def test_parallelism_defaults_to_one_and_is_unset_without_it() -> None:
    assert parse_job(base_job()).spec.parallelism is None
    job = base_job()
    job["spec"]["parallelism"] = {}
    p = parse_job(job).spec.parallelism
    assert p is not None and (p.tensor, p.pipeline) == (1, 1)
    assert validate_job(job) == [], "tensor x pipeline = 1 needs no nprocPerWorker"


def test_the_world_size_rule_is_every_size_of_the_bounds_in_closed_form() -> None:
    """The rule (and its CEL twin) checks one or two numbers; here, every world size the bounds
    allow, enumerated, decides the same for every small case."""
    checked = 0
    for replicas, low, high, nproc, tensor, pipeline in itertools.product(
        (1, 2, 3, 4), (None, 1, 2), (None, 3, 4, 6), (1, 2, 4), (1, 2, 4), (1, 2, 3)
    ):
        if (low or replicas) > replicas or replicas > (high or replicas) or nproc % tensor:
            continue
        sizes = range(low or replicas, (high or replicas) + 1)
        want = all(r * nproc % (tensor * pipeline) == 0 for r in sizes)
        problems = validate_job(_job(replicas, low, high, nproc, tensor, pipeline))
        assert (not any(WORLD_SIZES_MESSAGE in p for p in problems)) == want, (
            replicas,
            low,
            high,
            nproc,
            tensor,
            pipeline,
            problems,
        )
        checked += 1
    assert checked > 100


def test_the_messages_name_the_field_and_the_fix() -> None:
    assert validate_job(_job(2, 1, 3, 2, 2, 2)) == [
        "spec.parallelism: every world size replicas x nprocPerWorker from elastic.minReplicas to "
        "elastic.maxReplicas (unset: replicas) must be a multiple of parallelism.tensor x "
        "parallelism.pipeline; change the bounds, nprocPerWorker or parallelism"
    ]
    assert validate_job(_job(2, 2, 2, 2, 2, 2)) == [], (
        "a fixed size of 2 pods x 2 holds one TP2 x PP2 replica"
    )
    tensor_of_3 = _job(2, 1, 3, 4, 3, 1)
    assert (
        "spec.parallelism.tensor: parallelism.tensor must divide nprocPerWorker"
        in validate_job(tensor_of_3)[0]
    )
    no_nproc = base_job()
    no_nproc["spec"]["parallelism"] = {"pipeline": 2}
    assert validate_job(no_nproc) == [
        "spec.parallelism: parallelism with tensor x pipeline > 1 needs nprocPerWorker set (a "
        "tensor-parallel group is the processes of one pod)"
    ]


def _pod_env(**spec: Any) -> dict[str, str]:
    pod = worker_pod(JobView(make_job(**spec)), rank=1, world_size=2, generation=0, defaults=WorkerDefaults())
    return env_of(pod)


def test_the_operator_passes_declared_parallelism_to_every_pod() -> None:
    env = _pod_env(nprocPerWorker=2, parallelism={"tensor": 2})
    assert (env[contract.ENV_PARALLELISM_TENSOR], env[contract.ENV_PARALLELISM_PIPELINE]) == ("2", "1")
    assert (env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == ("4", "2")
    plain = _pod_env()
    assert contract.ENV_PARALLELISM_TENSOR not in plain and contract.ENV_PARALLELISM_PIPELINE not in plain


POD = {
    contract.ENV_WORLD_SIZE: "4",
    contract.ENV_RANK: "2",
    contract.ENV_LOCAL_WORLD_SIZE: "2",
    contract.ENV_PARALLELISM_TENSOR: "2",
    contract.ENV_PARALLELISM_PIPELINE: "1",
}


def test_the_pod_reader_types_the_declared_parallelism() -> None:
    env = contract.PodEnv.from_environ(POD)
    assert (env.parallelism_tensor, env.parallelism_pipeline) == (2, 1)
    assert (contract.PodEnv().parallelism_tensor, contract.PodEnv().parallelism_pipeline) == (None, None)
    with pytest.raises(contract.PodEnvError, match="DTJOB_PARALLELISM_TENSOR='0' is not a whole number >= 1"):
        contract.PodEnv.from_environ({contract.ENV_PARALLELISM_TENSOR: "0"})


def test_the_trainer_takes_the_declared_parallelism_and_refuses_a_disagreeing_flag() -> None:
    c = parse(["--global-batch-size", "4"], POD)
    assert (c.tensor_parallel, c.data_parallel_size) == (2, 2)
    assert parse(["--tensor-parallel", "2"], POD).tensor_parallel == 2, "an equal flag is fine"
    with pytest.raises(ConfigError) as err:
        parse(["--tensor-parallel", "1"], POD)
    assert str(err.value) == (
        "flag --tensor-parallel=1 disagrees with the job's spec.parallelism.tensor=2 (env "
        "DTJOB_PARALLELISM_TENSOR); drop it or make them equal"
    )
    with pytest.raises(ConfigError, match="environment variable DTJOB_TENSOR_PARALLEL=4 disagrees"):
        parse([], {**POD, "DTJOB_TENSOR_PARALLEL": "4"})
    with pytest.raises(
        ConfigError, match=r"spec.parallelism.pipeline=2 .* needs --strategy pipeline, not ddp"
    ):
        parse([], {**POD, contract.ENV_PARALLELISM_PIPELINE: "2"})
    # Without spec.parallelism the flags decide, as before (the pipeline's default stays 2).
    plain = parse(["--strategy", "pipeline"], {contract.ENV_WORLD_SIZE: "4"})
    assert (plain.tensor_parallel, plain.pipeline_stages, plain.data_parallel_size) == (1, 2, 2)


@pytest.mark.parametrize(
    ("argv", "environ", "message"),
    [
        (
            ["--tensor-parallel", "2"],
            {contract.ENV_WORLD_SIZE: "3"},
            "WORLD_SIZE=3 is not a multiple of --tensor-parallel (env DTJOB_TENSOR_PARALLEL)=2",
        ),
        (
            ["--tensor-parallel", "2", "--strategy", "pipeline", "--pipeline-stages", "2"],
            {contract.ENV_WORLD_SIZE: "6"},
            "WORLD_SIZE=6 is not a multiple of --tensor-parallel (env DTJOB_TENSOR_PARALLEL)=2 x "
            "--pipeline-stages (env DTJOB_PIPELINE_STAGES)=2; run a multiple of 4",
        ),
        (
            ["--tensor-parallel", "4"],
            {contract.ENV_WORLD_SIZE: "4", contract.ENV_LOCAL_WORLD_SIZE: "2"},
            "--tensor-parallel (env DTJOB_TENSOR_PARALLEL)=4 does not divide the 2 processes per pod",
        ),
        (
            ["--tensor-parallel", "2", "--model", "mlp"],
            {contract.ENV_WORLD_SIZE: "2"},
            "--model mlp has no tensor-parallel plan; use --model gpt, or your own loop with "
            "ElasticSession and tensor_parallel(model, plan={...})",
        ),
        (
            ["--tensor-parallel", "2", "--heads", "3", "--dim", "48"],
            {contract.ENV_WORLD_SIZE: "2"},
            "--heads (env DTJOB_HEADS)=3 is not divisible by --tensor-parallel (env DTJOB_TENSOR_PARALLEL)=2",
        ),
        (
            ["--tensor-parallel", "2", "--global-batch-size", "6"],
            {contract.ENV_WORLD_SIZE: "8"},
            "--global-batch-size (env DTJOB_GLOBAL_BATCH_SIZE)=6 is not divisible by the 4 data-parallel "
            "replicas",
        ),
        (["--tensor-parallel", "0"], {}, "--tensor-parallel (env DTJOB_TENSOR_PARALLEL) must be at least 1"),
    ],
)
def test_the_trainer_refuses_what_cannot_split_naming_the_flag(
    argv: list[str], environ: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError) as err:
        parse(argv, environ)
    assert message in str(err.value)


def test_the_global_batch_splits_over_data_parallel_replicas_only() -> None:
    """TP 2 at world 8: 4 replicas; 12 samples split 3 per replica (not 8 ways)."""
    c = parse(["--tensor-parallel", "2", "--global-batch-size", "12"], {contract.ENV_WORLD_SIZE: "8"})
    assert c.data_parallel_size == 4


def test_tensor_parallel_with_a_pipeline_is_accepted_and_replicas_are_t_x_p_processes() -> None:
    """TP 2 x PP 2 at world 8: 2 data-parallel replicas of 4 processes each."""
    argv = ["--tensor-parallel", "2", "--strategy", "pipeline", "--pipeline-stages", "2"]
    c = parse([*argv, "--global-batch-size", "8"], {contract.ENV_WORLD_SIZE: "8"})
    assert (c.tensor_parallel, c.stages, c.data_parallel_size) == (2, 2, 2)

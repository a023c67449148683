"""contract.PodEnv: the one typed reader of a trainer process's environment, and its consumers."""

from __future__ import annotations

import dataclasses
import re

import pytest

from dtjob import contract
from dtjob.contract import PodEnv, PodEnvError
from dtjob.launcher.agent import AgentSettings
from dtjob.launcher.local import child_env
from dtjob.trainer.config import ConfigError, TrainerConfig, env_of, parse

FULL = {
    contract.ENV_MASTER_ADDR: "job-worker-0.job.ns.svc",
    contract.ENV_MASTER_PORT: "29400",
    contract.ENV_WORLD_SIZE: "6",
    contract.ENV_RANK: "4",
    contract.ENV_LOCAL_RANK: "1",
    contract.ENV_LOCAL_WORLD_SIZE: "2",
    contract.ENV_POD_RANK: "2",
    contract.ENV_PODS: "3",
    contract.ENV_JOB_NAME: "job",
    contract.ENV_NAMESPACE: "ns",
    contract.ENV_GENERATION: "7",
    contract.ENV_JOB_UID: "uid-1",
    contract.ENV_CHECKPOINT_DIR: "/ckpt",
    contract.ENV_METRICS_PORT: "9400",
    contract.ENV_DEVICE: "cpu",
    contract.ENV_HEARTBEAT_TIMEOUT: "2.5",
    contract.ENV_AGENT_PORT: "29401",
    contract.ENV_RESTARTS_LEFT: "3",
    contract.ENV_PERMANENT_EXIT_CODES: "2, 126,127",
    contract.ENV_IN_PLACE_RESTARTS: "1",
    contract.ENV_RESTART_CAUSE: "rank 1 (pod 0) exited 137 (SIGKILL)",
    contract.ENV_RESTART_FAILED_AT: "1796198400.25",
    contract.ENV_SNAPSHOT_DIR: "/snapshots",
    contract.ENV_SNAPSHOT_EVERY: "5",
    contract.ENV_SNAPSHOT_MEMORY_LIMIT: "1048576",
    contract.ENV_PARALLELISM_TENSOR: "2",
    contract.ENV_PARALLELISM_PIPELINE: "1",
}


def test_every_variable_of_the_contract_is_a_field_and_every_field_a_variable() -> None:
    variables = [f.metadata["variable"] for f in dataclasses.fields(PodEnv)]
    assert sorted(variables) == sorted(contract.ENVIRONMENT)
    assert set(FULL) == set(contract.ENVIRONMENT), "FULL sets every variable"


def test_every_variable_is_read_typed() -> None:
    env = PodEnv.from_environ(FULL)
    assert env == PodEnv(
        master_addr="job-worker-0.job.ns.svc",
        master_port=29400,
        world_size=6,
        rank=4,
        local_rank=1,
        local_world_size=2,
        pod_rank=2,
        pods=3,
        job_name="job",
        namespace="ns",
        generation=7,
        job_uid="uid-1",
        checkpoint_dir="/ckpt",
        metrics_port=9400,
        device="cpu",
        heartbeat_timeout=2.5,
        agent_port=29401,
        restarts_left=3,
        permanent_exit_codes=frozenset({2, 126, 127}),
        in_place_restarts=1,
        restart_cause="rank 1 (pod 0) exited 137 (SIGKILL)",
        restart_failed_at=1796198400.25,
        snapshot_dir="/snapshots",
        snapshot_every=5,
        snapshot_memory_limit=1048576,
        parallelism_tensor=2,
        parallelism_pipeline=1,
    )
    assert env.value(contract.ENV_HEARTBEAT_TIMEOUT) == 2.5


def test_unset_or_empty_is_the_default_of_one_process_started_by_hand() -> None:
    assert PodEnv.from_environ({}) == PodEnv() == PodEnv.from_environ(dict.fromkeys(FULL, ""))
    plain = PodEnv()
    assert (plain.rank, plain.world_size, plain.master_addr, plain.master_port) == (0, 1, "127.0.0.1", 29500)
    assert (plain.checkpoint_dir, plain.metrics_port, plain.agent_port, plain.heartbeat_timeout) == (
        None,
        0,
        None,
        10.0,
    )
    assert PodEnv.from_environ({contract.ENV_AGENT_PORT: "0"}).agent_port is None


def test_pod_rank_and_pods_follow_from_the_ranks_when_unset() -> None:
    """RANK is the pod's first rank (the operator's): pod 1 of 2 pods of 2 processes has RANK 2."""
    env = PodEnv.from_environ(
        {contract.ENV_RANK: "2", contract.ENV_WORLD_SIZE: "4", contract.ENV_LOCAL_WORLD_SIZE: "2"}
    )
    assert (env.pod_rank, env.pods) == (1, 2)


@pytest.mark.parametrize(
    ("variable", "raw", "expected"),
    [
        (contract.ENV_RANK, "one", "a whole number >= 0"),
        (contract.ENV_RANK, "-1", "a whole number >= 0"),
        (contract.ENV_WORLD_SIZE, "0", "a whole number >= 1"),
        (contract.ENV_LOCAL_WORLD_SIZE, "2.0", "a whole number >= 1"),
        (contract.ENV_MASTER_PORT, "0", "a port number (1-65535)"),
        (contract.ENV_METRICS_PORT, "70000", "a port number (0-65535)"),
        (contract.ENV_DEVICE, "tpu", "one of auto, cpu, cuda"),
        (contract.ENV_HEARTBEAT_TIMEOUT, "10s", "a number of seconds"),
        (contract.ENV_PERMANENT_EXIT_CODES, "2,x", "a comma list of integers"),
    ],
)
def test_a_malformed_variable_is_named_with_its_form(variable: str, raw: str, expected: str) -> None:
    message = f"environment variable {variable}={raw!r} is not {expected}"
    with pytest.raises(PodEnvError, match=f"^{re.escape(message)}$"):
        PodEnv.from_environ({variable: raw})


def test_the_trainer_config_reads_the_pod_variables_through_the_contract() -> None:
    config = parse(["--global-batch-size", "12"], FULL)
    for f in dataclasses.fields(TrainerConfig):
        if env_of(f.name) in contract.ENVIRONMENT:
            assert getattr(config, f.name) == PodEnv.from_environ(FULL).value(env_of(f.name)), f.name
    assert parse(["--rank", "5", "--global-batch-size", "12"], FULL).rank == 5, (
        "a flag still beats the environment"
    )
    with pytest.raises(ConfigError, match="environment variable DTJOB_DEVICE='tpu' is not one of auto"):
        parse([], {contract.ENV_DEVICE: "tpu"})


def test_trainer_config_defaults_are_the_pod_defaults() -> None:
    """Unset, a pod variable gives the contract's default: the config's own must be the same."""
    shared = [f for f in dataclasses.fields(TrainerConfig) if env_of(f.name) in contract.ENVIRONMENT]
    assert len(shared) == 12
    for f in shared:
        assert f.default == PodEnv().value(env_of(f.name)), f.name


def test_the_agent_reads_the_pod_variables_through_the_contract() -> None:
    s = AgentSettings.from_env(FULL)
    assert (s.nproc, s.pod, s.pods, s.master_addr, s.agent_port, s.job_uid) == (
        2,
        2,
        3,
        "job-worker-0.job.ns.svc",
        29401,
        "uid-1",
    )
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE='0' is not a whole number >= 1"):
        AgentSettings.from_env({contract.ENV_LOCAL_WORLD_SIZE: "0"})


def test_a_pods_processes_get_consecutive_ranks_without_a_pod_rank() -> None:
    """Without DTJOB_POD_RANK the pod's RANK is its first process's: pod 1 of 2x2 holds ranks 2, 3."""
    pod = {contract.ENV_RANK: "2", contract.ENV_WORLD_SIZE: "4", contract.ENV_LOCAL_WORLD_SIZE: "2"}
    assert [child_env(pod, i)[contract.ENV_RANK] for i in (0, 1)] == ["2", "3"]
    with_pod_rank = {**pod, contract.ENV_POD_RANK: "1", contract.ENV_RANK: "2"}
    assert [child_env(with_pod_rank, i)[contract.ENV_RANK] for i in (0, 1)] == ["2", "3"]


def test_the_design_table_states_each_variables_form_and_default() -> None:
    assert contract.pod_env_form(contract.ENV_WORLD_SIZE) == "a whole number >= 1; unset: 1"
    pods = "a whole number >= 1; unset: WORLD_SIZE / LOCAL_WORLD_SIZE"
    assert contract.pod_env_form(contract.ENV_PODS) == pods
    assert contract.pod_env_form(contract.ENV_CHECKPOINT_DIR) == "text; unset: none"


def test_one_variable_reads_as_the_whole_environment_does() -> None:
    for variable in set(contract.ENVIRONMENT) - {contract.ENV_POD_RANK, contract.ENV_PODS}:
        assert PodEnv.read(variable, FULL) == PodEnv.from_environ(FULL).value(variable), variable
        assert PodEnv.read(variable, {}) == PodEnv().value(variable), variable
    with pytest.raises(PodEnvError, match="LOCAL_WORLD_SIZE='0' is not a whole number >= 1"):
        PodEnv.read(contract.ENV_LOCAL_WORLD_SIZE, {contract.ENV_LOCAL_WORLD_SIZE: "0"})
    with pytest.raises(ValueError, match="DTJOB_PODS unset follows from other variables"):
        PodEnv.read(contract.ENV_PODS, FULL)

"""A malformed pod variable raises each consumer's own error, naming the variable (contract.PodEnv)."""

from __future__ import annotations

import pytest

from dtjob import contract
from dtjob.trainer import heartbeat
from dtjob.trainer.collectives import hierarchical
from dtjob.trainer.collectives.errors import InvalidArgument
from dtjob.trainer.elastic import Gang, RendezvousError


def test_the_gang_names_a_malformed_variable() -> None:
    with pytest.raises(RendezvousError, match="environment variable RANK='x' is not a whole number >= 0"):
        Gang.from_env({contract.ENV_RANK: "x"})
    gang = Gang.from_env(
        {contract.ENV_RANK: "3", contract.ENV_WORLD_SIZE: "4", contract.ENV_MASTER_PORT: "1234"}
    )
    assert (gang.rank, gang.world_size, gang.master_addr, gang.master_port) == (3, 4, "127.0.0.1", 1234)


def test_collectives_and_heartbeat_name_a_malformed_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(contract.ENV_LOCAL_WORLD_SIZE, "0")
    with pytest.raises(InvalidArgument, match="LOCAL_WORLD_SIZE='0' is not a whole number >= 1"):
        hierarchical.local_world_size(None)
    monkeypatch.setenv(contract.ENV_LOCAL_WORLD_SIZE, "3")
    assert hierarchical.local_world_size(None) == 3
    monkeypatch.setenv(contract.ENV_HEARTBEAT_TIMEOUT, "ten")
    with pytest.raises(ValueError, match="DTJOB_HEARTBEAT_TIMEOUT='ten' is not a number of seconds"):
        heartbeat.start("prefix", "127.0.0.1", 1, 0, 2)
    monkeypatch.setenv(contract.ENV_HEARTBEAT_TIMEOUT, "0")
    assert heartbeat.start("prefix", "127.0.0.1", 1, 0, 2) is None, "0: no heartbeat"

"""The collectives' worker thread per process group (collectives/work.py), in one process."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from dtjob.trainer.collectives.work import GroupRunner


@pytest.fixture
def one_process_group() -> Iterator[dist.ProcessGroup]:
    dist.init_process_group(
        "gloo", store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=30)
    )
    yield dist.group.WORLD
    dist.destroy_process_group()


def test_closing_a_runner_waits_until_its_thread_ended_and_freed_the_last_calls_tensors(
    one_process_group: dist.ProcessGroup,
) -> None:
    # A tensor freed on a daemon thread while the interpreter shuts down aborts the process
    # (exit 134): close() must leave nothing for the thread to free later.
    runner = GroupRunner(one_process_group, weak=False)
    held = torch.ones(4)
    alive = weakref.ref(held)

    def job(tag: int, tensor: torch.Tensor = held) -> str:
        tensor.add_(1)
        return "test"

    work = runner.submit(job, async_op=True, result=[held], device=torch.device("cpu"))
    assert work is not None
    work.wait()
    thread = runner._thread
    assert thread is not None and thread.is_alive()
    del job, work, held
    gc.collect()
    runner.close()
    assert not thread.is_alive(), "close() returned while the worker thread still ran"
    assert alive() is None, "the worker thread still held the last call's tensor"

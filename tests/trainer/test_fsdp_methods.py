"""The user's model methods on a fully_shard'ed model (issue #40): Hugging Face generate(),
get_encoder() / get_decoder(), the embeddings and a submodule's eval forward run on the full
parameters and give the unwrapped model's results at ZeRO 1, 2 and 3, before and after training
steps, without disturbing training; unshard() / reshard() / summon_full_params() round trip.

One real 2-rank gloo group runs every check (fsdp_methods_worker.py); each test reads its result.
"""

from __future__ import annotations

import multiprocessing
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.trainer import fsdp_methods_worker as worker
from tests.trainer.runtime_gang import free_port


def _run(rank: int, port: int, results: multiprocessing.Queue[Any]) -> None:
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, worker.WORLD, rank == 0)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=worker.WORLD)
    results.put((rank, worker.run_checks()))
    dist.barrier()
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def outcomes() -> list[dict[str, str]]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_run, args=(r, port, results)) for r in range(worker.WORLD)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return [got[r] for r in range(worker.WORLD)]


def _assert_ok(outcomes: list[dict[str, str]], name: str) -> None:
    for rank, out in enumerate(outcomes):
        assert out[name] == "ok", f"rank {rank}: {out[name]}"


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gpt2_generate_and_embeddings_equal_the_unwrapped_model_before_and_after_training(
    outcomes: list[dict[str, str]], stage: int
) -> None:
    _assert_ok(outcomes, f"gpt2-generate-zero{stage}")


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_unshard_holds_the_full_parameters_until_reshard(outcomes: list[dict[str, str]], stage: int) -> None:
    _assert_ok(outcomes, f"unshard-zero{stage}")


@pytest.mark.slow
def test_t5_zero3_trains_as_one_process_and_its_encoder_and_decoder_run_outside_a_step(
    outcomes: list[dict[str, str]],
) -> None:
    _assert_ok(outcomes, "t5-zero3")


@pytest.mark.slow
def test_a_user_method_that_runs_the_forward_with_gradients_trains_as_one_process(
    outcomes: list[dict[str, str]],
) -> None:
    _assert_ok(outcomes, "train-through-method")

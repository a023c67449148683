"""Stopping and failing: SIGTERM checkpoints and exits 75 (and the metrics endpoint tells the
world meanwhile), a lost peer fails the survivors instead of hanging, and a worker of another
generation refuses to join. Real `python -m dtjob.trainer` gangs over gloo on localhost."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest

from tests.trainer.runtime_gang import (
    TINY_GPT,
    checkpoint_steps,
    free_port_run,
    launch,
    run,
    scrape,
    wait_for,
)

pytestmark = pytest.mark.slow

# --steps is far beyond what the test lets run: these gangs are stopped from outside.
ENDLESS = [*TINY_GPT, "--global-batch-size", "4", "--steps", "100000", "--collective", "native"]


def _metrics_at_step(port: int, step: int) -> dict[str, float]:
    seen: dict[str, float] = {}

    def ready() -> bool:
        page = scrape(port)
        if page is None:
            return False
        seen.clear()
        seen.update(page)
        return (
            page.get("dtjob_trainer_step", 0) >= step
            and page.get("dtjob_trainer_last_checkpoint_step", 0) > 0
        )

    wait_for(ready, f"metrics on port {port} to reach step {step}")
    return seen


def test_sigterm_checkpoints_exits_75_and_resume_repeats_no_step(tmp_path: Path) -> None:
    checkpoints = tmp_path / "ckpt"
    port = free_port_run(2)
    args = [*ENDLESS, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "3"]
    gang = launch(2, [*args, "--metrics-port", str(port)], tmp_path, "first", generations=[4, 4])
    try:
        m = _metrics_at_step(port, 4)
        assert m["dtjob_trainer_world_size"] == 2 and m["dtjob_trainer_generation"] == 4
        assert m["dtjob_trainer_loss"] > 0 and m["dtjob_trainer_samples_per_second"] > 0
        assert m["dtjob_trainer_last_checkpoint_step"] % 3 == 0
        assert m["dtjob_trainer_last_checkpoint_timestamp_seconds"] > 1.7e9
        assert m["dtjob_trainer_checkpoint_save_seconds"] > 0
        all_reduce_bytes = [v for k, v in m.items() if k.startswith("dtjob_trainer_collective_bytes_total{")]
        assert sum(all_reduce_bytes) > 0, sorted(m)
        rank1 = scrape(port + 1)  # LOCAL_RANK 1 serves on the next port
        assert rank1 is not None and rank1["dtjob_trainer_rank"] == 1

        gang.signal(1, signal.SIGTERM)  # one rank only: the gang must agree to stop together
        codes = gang.wait()
    finally:
        gang.kill()
    assert codes == [75, 75], gang.stderr()
    steps = [s["step"] for s in gang.steps()]
    stopped_at = steps[-1]
    assert steps == list(range(1, stopped_at + 1))
    assert checkpoint_steps(checkpoints)[-1] == stopped_at, "no checkpoint at the step it stopped after"

    finish = [a if a != "100000" else str(stopped_at + 3) for a in args]
    resumed = run(2, finish, tmp_path, "second")
    assert [s["step"] for s in resumed.steps()] == [stopped_at + 1, stopped_at + 2, stopped_at + 3]


@pytest.mark.parametrize("heartbeat", ["4", "0"], ids=["named-by-the-heartbeat", "heartbeat-off"])
def test_lost_peer_makes_the_survivor_fail_instead_of_hang(tmp_path: Path, heartbeat: str) -> None:
    """A peer's process killed: the survivor's collective fails at once ("Connection closed by
    peer"); with the heartbeat on, the survivor waits for it to name the lost rank and exits 76
    (the operator then knows which pod to replace, even on a node that looks alive)."""
    env = {"DTJOB_HEARTBEAT_TIMEOUT": heartbeat}
    gang = launch(2, [*ENDLESS, "--collective-timeout", "20"], tmp_path, "lost", env=env)
    # The collective timeout is 20 s; the 90 s wait allows for a slow, shared machine on top.
    code = gang.kill_rank_1_after_three_steps(timeout=90)
    if heartbeat == "0":
        assert code not in (0, 75), gang.stderr(0)
        assert "rank 0 failed" in gang.stderr(0)
    else:
        assert code == 76, gang.stderr(0)
        assert "peer lost: rank 1 silent for" in gang.stderr(0), gang.stderr(0)
        # The collective saw it first ("Connection reset by peer" or "closed by peer", gloo's words).
        assert "by peer" in gang.stderr(0) and "waiting up to 5s for the heartbeat" in gang.stderr(0)


def test_worker_of_an_older_generation_cannot_join(tmp_path: Path) -> None:
    gang = launch(2, [*ENDLESS, "--rendezvous-timeout", "60"], tmp_path, "stale", generations=[5, 4])
    try:
        code = gang.procs[1].wait(timeout=90)
    finally:
        gang.kill()
    assert code == 3, gang.stderr(1)
    last_line = gang.stderr(1).strip().splitlines()[-1]
    assert "DTJOB_GENERATION=4" in last_line and "generation 5" in last_line
    assert gang.steps() == []


@pytest.mark.parametrize(
    ("world", "stopped"), [(3, 1), (3, 0), (2, 1)], ids=["a-worker", "rank-0-the-store", "of-two"]
)
def test_a_hung_rank_is_found_by_the_heartbeat_long_before_the_collective_timeout(
    tmp_path: Path, world: int, stopped: int
) -> None:
    """SIGSTOP keeps a rank's sockets open, so its peers' collectives would wait the whole
    --collective-timeout (120 s here); the heartbeat (4 s) ends the gang first, naming the rank."""
    import time

    args = [*ENDLESS, "--global-batch-size", "6", "--collective-timeout", "120"]
    gang = launch(world, args, tmp_path, "hung", env={"DTJOB_HEARTBEAT_TIMEOUT": "4"})
    survivors = [r for r in range(world) if r != stopped]
    try:
        wait_for(lambda: len(gang.steps()) >= 3, "three steps")
        gang.signal(stopped, signal.SIGSTOP)
        stopped_at = time.monotonic()
        codes = [gang.procs[r].wait(timeout=60) for r in survivors]
        seconds = time.monotonic() - stopped_at
    finally:
        gang.procs[stopped].send_signal(signal.SIGCONT)
        gang.kill()
    assert codes == [76] * len(survivors), gang.stderr()
    for r in survivors:
        assert f"peer lost: rank {stopped} silent for" in gang.stderr(r), gang.stderr(r)
    # 4 s of silence, a beat a second, two for the others to see the verdict; a loaded machine
    # adds to it, but never the 120 s collective timeout.
    assert seconds < 30, seconds


def test_a_verdict_left_in_torchruns_store_by_an_earlier_gang_does_not_end_the_next(tmp_path: Path) -> None:
    """Under torchrun every rank is a client of the agent's store (TORCHELASTIC_USE_AGENT_STORE),
    which outlives the gangs it serves: each restart round at the same world size finds what the
    gangs before it left under the same prefix. Here the store (hosted by the test, as the agent
    hosts it) holds the heartbeat's verdict of a gang that lost rank 1; the next gang must train."""
    from datetime import timedelta

    import torch.distributed as dist

    port = free_port_run(1)
    store = dist.TCPStore(
        "127.0.0.1", port, 2, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30)
    )
    earlier = "dtjob/g0/ws2/hb"  # where a gang of generation 0 at world size 2 kept its heartbeat
    store.set(f"{earlier}/lost-rank", "1")
    store.add(f"{earlier}/lost", 1)
    store.add(f"{earlier}/done/1", 1)  # and a rank that said it finished: nobody would watch it
    args = [*TINY_GPT, "--global-batch-size", "4", "--steps", "6", "--collective", "native"]
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", "DTJOB_HEARTBEAT_TIMEOUT": "4"}
    gang = run(2, args, tmp_path, "next", env=env, master_port=port)
    assert [s["step"] for s in gang.steps()] == list(range(1, 7))
    assert "peer lost" not in gang.stderr()


def test_a_gang_a_newer_generation_replaced_stops_and_publishes_no_checkpoint(tmp_path: Path) -> None:
    """Generation 0 still running (its pods force-deleted from a silent node: nothing killed them)
    when generation 1 starts on the same checkpoint directory: generation 1's claim stops it within
    a second or two, it writes no checkpoint after that claim, and a gang of generation 0 started
    later refuses to start at all."""
    checkpoints = tmp_path / "ckpt"
    args = [*ENDLESS, "--checkpoint-dir", str(checkpoints), "--checkpoint-every", "2"]
    env = {"DTJOB_JOB_UID": "uid-gpt", "DTJOB_HEARTBEAT_TIMEOUT": "4"}
    old = launch(2, args, tmp_path, "old", generations=[0, 0], env=env)
    gate = tmp_path / "gate"
    gate.write_text("0")  # the new gang claims the directory, then waits before its first step
    new = stale = None
    try:
        wait_for(lambda: len(old.steps()) >= 3, "generation 0 training")
        new = launch(1, args, tmp_path, "new", generations=[1], env={**env, "DTJOB_STEP_GATE": str(gate)})
        owner = checkpoints / ".owner"
        claimed = lambda: owner.exists() and '"generation": 1' in owner.read_text()  # noqa: E731
        wait_for(claimed, "generation 1's claim", timeout=90)
        claimed_at = owner.stat().st_mtime
        codes = old.wait(timeout=60)
        assert codes[0] == 3, old.stderr()
        assert "superseded: generation 1 of job uid uid-gpt" in old.stderr(0)
        assert codes[1] != 0, "rank 1 leaves once rank 0 is gone"
        for manifest in checkpoints.glob("step-*/manifest.json"):
            written = json.loads(manifest.read_text())
            assert written["generation"] == 0 and written["time"] < claimed_at, (
                f"generation 0 published {manifest.parent.name} after generation 1 claimed the directory"
            )
        stale = launch(1, args, tmp_path, "stale", generations=[0], env=env)
        assert stale.wait(timeout=60) == [3], stale.stderr()
        assert "generation 0 is stale: generation 1 of this job" in stale.stderr(0)
        assert new.procs[0].poll() is None, "the newest gang holds its claim"
    finally:
        for gang in (old, new, stale):
            if gang is not None:
                gang.kill()

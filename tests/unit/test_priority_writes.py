"""The writer's priorities (dtjob.operator.priority_pool): the most urgent write first, and new
jobs admitted (JobWriter.admit) only as fast as the pod writes queued go out."""

from __future__ import annotations

import threading
import time
from typing import Any

from dtjob.operator.actions import Action, CreatePod, DeletePod, EmitEvent, PatchStatus
from dtjob.operator.jobview import JobView
from dtjob.operator.priority_pool import PriorityPool
from dtjob.operator.writer import JobWriter
from tests.unit.reconciler_fixtures import make_job, make_pod


def job(name: str, started: bool) -> dict[str, Any]:
    made = make_job(status={"phase": "Running", "generation": 0} if started else None)
    made["metadata"] = {**made["metadata"], "name": name, "uid": f"uid-{name}"}
    return made


def create(name: str, rank: int) -> CreatePod:
    manifest = make_pod(rank, node=None)
    manifest.pop("status")
    manifest["metadata"]["name"] = f"{name}-worker-{rank}"
    return CreatePod(manifest)


def test_the_most_urgent_call_runs_first_and_calls_of_one_priority_in_order() -> None:
    pool = PriorityPool(1, "test")
    gate, holding, ran = threading.Event(), threading.Event(), []

    def hold() -> None:
        holding.set()
        assert gate.wait(10)

    pool.submit(hold)  # holds the only thread while the rest queue
    assert holding.wait(5)
    futures = [
        pool.submit(ran.append, name, priority=p)
        for name, p in (("c1", 2), ("b1", 1), ("a1", 0), ("c2", 2), ("a2", 0), ("b2", 1))
    ]
    assert pool.queued() == 6
    gate.set()
    for f in futures:
        f.result(5)
    assert ran == ["a1", "a2", "b1", "b2", "c1", "c2"]
    assert pool.submit(lambda: 1 / 0).exception(5).__class__ is ZeroDivisionError


def test_a_held_priority_waits_until_admitted_while_a_more_urgent_one_runs() -> None:
    open_ = threading.Event()
    pool = PriorityPool(2, "test", admits=lambda p: p == 0 or open_.is_set())
    held = pool.submit(lambda: "held", priority=1)
    assert pool.submit(lambda: "urgent", priority=0).result(5) == "urgent"
    time.sleep(0.2)
    assert not held.done() and pool.queued() == 1
    open_.set()
    pool.poke()
    assert held.result(5) == "held"


class Writes:
    """The writer's write functions, recording in order; every pod write waits at `gate`."""

    def __init__(self) -> None:
        self.log: list[str] = []
        self.lock = threading.Lock()
        self.gate = threading.Event()
        self.sending = threading.Event()  # a pod write is held at the gate

    def head(self, view: JobView, action: Action) -> None:
        self.note(f"status {view.name}")

    def pod(self, namespace: str, write: CreatePod | DeletePod) -> None:
        self.sending.set()
        assert self.gate.wait(10)
        self.note(f"{type(write).__name__} {write.name}")

    def event(self, view: JobView, event: EmitEvent) -> None:
        self.note(f"event {event.reason}")

    def note(self, text: str) -> None:
        with self.lock:
            self.log.append(text)


def ignore(error: Exception | None) -> None:
    assert error is None


def test_new_jobs_are_admitted_in_order_as_the_pod_writes_queued_go_out() -> None:
    writes = Writes()
    writer = JobWriter(writes.head, writes.pod, writes.event, head_concurrency=2, pod_concurrency=1)
    turns: list[str] = []
    assert writer.admit(("ml", "a"), lambda: turns.append("a")), "an idle pool admits at once"
    # a's 3 creations: one on the pool's only thread (held at the gate), 2 queued for it.
    writer.submit(job("a", False), [create("a", r) for r in range(3)], ignore, ignore)
    assert writes.sending.wait(5)
    for name in ("b", "c", "d"):
        assert not writer.admit(("ml", name), lambda name=name: turns.append(name))
    assert not writer.admit(("ml", "b"), lambda: turns.append("b again")), "b keeps its place"
    writer.forget(("ml", "c"))  # deleted while it waited
    started = writer.submit(job("e", True), [PatchStatus({"phase": "Restarting"})], ignore, ignore)
    assert started is not None
    started.result(5)
    assert writes.log == ["status e"], "a started job's writes do not wait for admission"
    writes.gate.set()
    deadline = time.monotonic() + 5
    while len(turns) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert turns == ["b", "d"], "once one queued write is left: b, then d (c was forgotten)"
    assert writer.admit(("ml", "b"), lambda: None) and writer.admit(("ml", "d"), lambda: None)


def test_deletions_go_before_creations_and_events() -> None:
    writes = Writes()
    writer = JobWriter(writes.head, writes.pod, writes.event, head_concurrency=1, pod_concurrency=1)
    done = threading.Event()
    writer.submit(job("a", True), [create("a", 0)], ignore, ignore)  # holds the pod pool's thread
    assert writes.sending.wait(5)
    writer.submit(
        job("b", True),
        [EmitEvent("Normal", "Restart", ""), create("b", 1), DeletePod("b-worker-0", "restart")],
        ignore,
        lambda error: done.set(),
    )
    writes.gate.set()
    assert done.wait(5)
    deadline = time.monotonic() + 5
    while len(writes.log) < 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert writes.log == [
        "CreatePod a-worker-0",
        "DeletePod b-worker-0",
        "event Restart",
        "CreatePod b-worker-1",
    ]

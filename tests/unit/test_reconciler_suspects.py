"""A rank its peers declared lost: its pod forced and its node avoided in the pass that restarts the
gang (dtjob.operator.suspects), so the next gang is created at once; the old path where the other
nodes have no room for it; a false suspicion lifted at the node's next Lease renewal."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from dtjob import contract
from dtjob.operator.jobview import JobView
from dtjob.operator.kube import LEASE_READS, Kube
from dtjob.operator.nodes import LOST_RANK_GRACE_SECONDS
from dtjob.operator.observed import WorkerCache
from dtjob.operator.reconciler import plan
from dtjob.operator.settings import ReconcilerSettings
from dtjob.operator.suspects import REASON
from tests.unit.reconciler_fixtures import (
    creates,
    deletes,
    events,
    gang,
    make_job,
    make_node,
    make_pod,
    observed,
    run,
    running_status,
    status_patch,
)

LEASE = "2026-01-01T12:01:38.500000Z"  # n2's kubelet renewed its Lease last at this moment
NOT_IN_N2 = [{"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["n2"]}]}]


def three_nodes() -> list[dict[str, Any]]:
    """Two for the gang of 4 one-cpu workers, and n3 with room for two of them."""
    return [make_node("n1"), make_node("n2"), make_node("n3")]


def rank_2_lost() -> list[dict[str, Any]]:
    """Ranks 0, 1 (n1) and 3 (n2) exited 76 naming rank 2, which runs on n2 (stopped, or hung)."""
    pods = gang(4)
    for rank in (0, 1, 3):
        pods[rank] = make_pod(rank, node=pods[rank]["spec"]["nodeName"], phase="Failed", exit_code=76)
    return pods


def logs() -> dict[str, str]:
    return {f"gpt-worker-{r}": f"ERROR {contract.peer_lost_line(2, 4.0)}\n" for r in (0, 1, 3)}


def affinity(pod: dict[str, Any]) -> Any:
    spec = pod["spec"].get("affinity") or {}
    return (
        spec.get("nodeAffinity", {})
        .get("requiredDuringSchedulingIgnoredDuringExecution", {})
        .get("nodeSelectorTerms")
    )


def test_a_lost_rank_is_forced_its_node_avoided_and_the_next_gang_created_at_once() -> None:
    job = make_job(status=running_status())
    actions = run(job, rank_2_lost(), three_nodes(), worker_logs=logs(), leases={"n2": LEASE})
    patch = status_patch(actions)
    assert (patch["phase"], patch["generation"], patch["restarts"]) == ("Restarting", 1, 1)
    assert "replicas" not in patch, "4 workers fit beside n2 (n1 and n3): the gang keeps its size"
    assert {d.name: d.grace_seconds for d in deletes(actions)} == {f"gpt-worker-{r}": 0 for r in range(4)}
    assert "node n2 suspected" in next(d for d in deletes(actions) if d.name == "gpt-worker-2").reason
    assert patch["silentNodes"] == [{"name": "n2", "since": "2026-01-01T12:01:40Z", "leaseRenewTime": LEASE}]
    [suspect] = [e for e in events(actions) if e.reason == REASON]
    assert suspect.type == "Warning" and "gpt-worker-2" in suspect.message and "node n2" in suspect.message

    # A force deletion frees the names at once: the next pass (0.2 s later) creates the whole gang,
    # away from n2, and looks at n2's Lease again at every tick.
    job = make_job(status={**job["status"], **patch})
    decided = plan(observed(job, [], three_nodes(), now=100.2, leases={"n2": LEASE}), ReconcilerSettings())
    made = creates(decided.actions)
    assert len(made) == 4 and decided.poll
    assert all(affinity(c.manifest) == NOT_IN_N2 for c in made)


def test_a_false_suspicion_ends_at_the_nodes_next_lease_renewal() -> None:
    """A trainer SIGSTOPped (or a pod cut off) on a healthy node: its kubelet renews the Lease
    within 10 s (the nodelet: 4 s), and from then new workers may use the node again."""
    job = make_job(status=running_status())
    patch = status_patch(run(job, rank_2_lost(), three_nodes(), worker_logs=logs(), leases={"n2": LEASE}))
    job = make_job(status={**job["status"], **patch})
    renewed = {"n2": "2026-01-01T12:01:42.500000Z"}
    later = run(job, [], three_nodes(), now=104.0, leases=renewed)
    assert status_patch(later).get("silentNodes") == []
    assert len(creates(later)) == 4 and all(affinity(c.manifest) is None for c in creates(later))


def test_other_live_workers_on_the_suspected_node_are_forced_too() -> None:
    job = make_job(status=running_status())
    pods = rank_2_lost()
    pods[3] = make_pod(3, node="n2")  # still running: its own heartbeat round has not ended yet
    actions = run(job, pods, three_nodes(), worker_logs=logs())
    assert {d.name: d.grace_seconds for d in deletes(actions)}["gpt-worker-3"] == 0


def test_without_room_beside_the_node_the_lost_rank_gets_a_grace_and_the_event_says_why() -> None:
    """Two nodes, each holding two of the 4 workers: avoiding n2 would leave room for 2, so the
    old path stays (a 1 s grace: a live kubelet kills it within a second)."""
    job = make_job(status=running_status())
    nodes = [make_node("n1"), make_node("n2")]
    actions = run(job, rank_2_lost(), nodes, worker_logs=logs(), leases={"n2": LEASE})
    assert {d.name: d.grace_seconds for d in deletes(actions)}["gpt-worker-2"] == LOST_RANK_GRACE_SECONDS
    assert not status_patch(actions).get("silentNodes")
    assert not [e for e in events(actions) if e.reason == REASON]
    # A silent node leaves it unfinished: forced 2 s past its grace, and the NodeSilent event
    # says why it was not avoided at once.
    status = {**running_status(generation=1, restarts=1), "phase": "Restarting"}
    stuck = make_pod(2, 0, node="n2", deleting=True, grace_ends=97.0, grace=LOST_RANK_GRACE_SECONDS)
    later = run(make_job(status=status), [stuck], nodes, now=99.0)
    [silent] = [e for e in events(later) if e.reason == "NodeSilent"]
    assert "had no room for the whole next gang" in silent.message


def test_a_lost_rank_on_a_node_already_notready_is_lost_not_suspected() -> None:
    job = make_job(status=running_status())
    nodes = [make_node("n1"), make_node("n2", ready=False), make_node("n3")]
    actions = run(job, rank_2_lost(), nodes, worker_logs=logs())
    assert {d.name: d.grace_seconds for d in deletes(actions)}["gpt-worker-2"] == 0
    assert not [e for e in events(actions) if e.reason == REASON]


def test_the_observer_reads_the_leases_of_the_live_workers_nodes_once_a_peer_exited_76() -> None:
    job = JobView(make_job(status=running_status()))
    observer: Any = SimpleNamespace(workers=WorkerCache())
    assert Kube._nodes_of_lost_ranks(observer, job, rank_2_lost()) == {"n2"}
    assert Kube._nodes_of_lost_ranks(observer, job, gang(4)) == set(), "no peer lost: no read"
    many = [make_pod(0, node="n0", phase="Failed", exit_code=76)]
    many += [make_pod(r, node=f"n{r}") for r in range(1, 40)]
    assert len(Kube._nodes_of_lost_ranks(observer, job, many)) == LEASE_READS


def test_with_two_processes_per_pod_the_named_trainer_rank_picks_its_pod() -> None:
    """Trainer rank 5 of 8 runs in pod 2 (ranks 4 and 5), on n2: that pod is forced and n2
    avoided, not pod 5 or its node."""
    job = make_job(status=running_status(), nprocPerWorker=2)
    line = f"ERROR {contract.peer_lost_line(5, 4.0)}\n"
    actions = run(job, rank_2_lost(), three_nodes(), worker_logs={f"gpt-worker-{r}": line for r in (0, 1, 3)})
    assert "rank 5 (gpt-worker-2) lost" in (status_patch(actions)["conditions"][-1]["message"])
    assert "node n2 suspected" in next(d for d in deletes(actions) if d.name == "gpt-worker-2").reason
    assert [e["name"] for e in status_patch(actions)["silentNodes"]] == ["n2"]

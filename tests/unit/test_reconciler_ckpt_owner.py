"""One writer per checkpoint directory (reconciler rule 2, dtjob.operator.ownership): a job whose
directory another live job of its namespace owns is held with no pods, says so, and starts on its
own once the owner finishes or is deleted."""

from __future__ import annotations

import copy
from typing import Any

from dtjob.operator.actions import CreateService
from dtjob.operator.cache import ClusterCache, Informer, _namespace_of
from dtjob.operator.kube import Kube
from dtjob.operator.ownership import CheckpointDir, Claim, checkpoint_dir, claims, released
from dtjob.operator.reconciler import plan
from dtjob.operator.settings import ReconcilerSettings
from dtjob.operator.timefmt import to_rfc3339
from tests.unit.reconciler_fixtures import (
    applied,
    at,
    creates,
    events,
    make_job,
    make_pod,
    observed,
    run,
    running_status,
    status_patch,
    two_nodes,
    waiting,
)

PVC = {"persistentVolumeClaim": {"claimName": "shared"}}


def job_on(
    name: str, volume: dict[str, Any], created: float, status: dict[str, Any] | None = None, **kw: Any
) -> dict[str, Any]:
    """A job `name` of namespace ml whose checkpoints live on `volume`, created at `created` s."""
    job = make_job(status=status, **kw)
    job["metadata"].update(name=name, uid=f"uid-{name}", creationTimestamp=to_rfc3339(at(created)))
    job["spec"]["checkpoint"] = {"mountPath": "/ckpt", "volume": copy.deepcopy(volume)}
    return job


def no_pods(_: str) -> list[dict[str, Any]]:
    return []


def pass_of(job: dict[str, Any], others: list[dict[str, Any]], now: float = 100.0) -> list[Any]:
    """One pass of `job` observing the other jobs of its namespace as the operator's cache would."""
    found = claims(job, others, no_pods)
    return run(job, [], two_nodes(), now=now, checkpoint_claims=found)


def test_a_second_job_on_the_same_claim_is_held_naming_the_first_and_starts_once_it_finishes() -> None:
    first = job_on("first", PVC, created=0, status=running_status())
    second = job_on("second", PVC, created=10)
    actions = run(
        second, [], two_nodes(), service_exists=False, checkpoint_claims=claims(second, [first], no_pods)
    )
    assert creates(actions) == [], "held: no pods"
    assert not any(isinstance(a, CreateService) for a in actions), "nor its Service"
    reason, message = waiting(actions) or ("", "")
    assert reason == "CheckpointDirInUse"
    assert (
        "first" in message
        and "spec.checkpoint.volume" in message
        and "persistentVolumeClaim shared" in message
    )
    [event] = events(actions)
    assert (event.type, event.reason, event.message) == ("Warning", "CheckpointDirInUse", message)
    status = status_patch(actions)
    assert "phase" not in status and "startTime" not in status, "not started: no deadline or goodput runs"
    seen = observed(second, [], two_nodes(), checkpoint_claims=claims(second, [first], no_pods))
    assert plan(seen, ReconcilerSettings()).poll, (
        "its owner's last pods stopping announce nothing: look again"
    )

    # The next pass, same view: the same hold, no second event.
    held = applied(second, actions)
    again = pass_of(held, [first, held], now=105)
    assert creates(again) == [] and events(again) == []

    # The first job still suspended is live: it resumes from that directory.
    suspended = {**running_status(), "phase": "Suspended"}
    assert creates(pass_of(held, [job_on("first", PVC, 0, status=suspended), held], now=106)) == []

    # The first job succeeds: the second starts, its Waiting condition cleared.
    done = job_on("first", PVC, created=0, status={**running_status(), "phase": "Succeeded"})
    started = pass_of(held, [done, held], now=110)
    assert [p.name for p in creates(started)] == [f"second-worker-{r}" for r in range(4)]
    assert status_patch(started)["phase"] == "Pending"
    assert (waiting(started) or ("",))[0] == "Workers", "waits for its workers now, not the directory"
    assert status_patch(started)["startTime"] == to_rfc3339(at(110))

    # Or the first job is deleted (gone from the cache): the second starts as well.
    assert len(creates(pass_of(held, [held], now=110))) == 4


def test_the_older_job_owns_by_creation_time_then_name_and_never_waits_for_a_younger_one() -> None:
    older, younger = job_on("zeta", PVC, created=0), job_on("alpha", PVC, created=5)
    assert len(creates(pass_of(older, [older, younger]))) == 4, "two new jobs at once: the older starts"
    assert creates(pass_of(younger, [older, younger])) == []
    same_a, same_b = job_on("a", PVC, created=0), job_on("b", PVC, created=0)
    assert len(creates(pass_of(same_a, [same_a, same_b]))) == 4, "the same second: the name decides"
    assert creates(pass_of(same_b, [same_a, same_b])) == []
    # A job that started first owns it, even when a job its first pass did not see yet is older.
    started = job_on("late", PVC, created=9, status=running_status())
    unseen = job_on("early", PVC, created=1)
    assert creates(pass_of(unseen, [started, unseen])) == []
    assert "late" in (waiting(pass_of(unseen, [started, unseen])) or ("", ""))[1]


def test_jobs_on_different_directories_both_run() -> None:
    first = job_on("first", PVC, created=0, status=running_status())
    volumes = [
        {"persistentVolumeClaim": {"claimName": "other"}},
        {"hostPath": {"path": "/data/ckpt"}},
        {"nfs": {"server": "nfs.example", "path": "/exports/ckpt"}},
        {"emptyDir": {}},
    ]
    for volume in volumes:
        second = job_on("second", volume, created=10)
        assert len(creates(pass_of(second, [first, second]))) == 4, volume
    on_sibling = job_on("first", {"hostPath": {"path": "/data/ckpt-a"}}, 0, status=running_status())
    second = job_on("second", {"hostPath": {"path": "/data/ckpt"}}, created=10)
    assert len(creates(pass_of(second, [on_sibling, second]))) == 4, "/data/ckpt-a is not inside /data/ckpt"
    elsewhere = job_on("first", PVC, 0, status=running_status())
    elsewhere["metadata"]["namespace"] = "other-team"
    second = job_on("second", PVC, created=10)
    assert len(creates(pass_of(second, [elsewhere, second]))) == 4, "a claim is per namespace"
    without = make_job()
    del without["spec"]["checkpoint"]
    assert len(creates(pass_of(without, [first]))) == 4, "no checkpoint directory, nothing to own"


def test_paths_are_normalised_and_a_directory_inside_another_is_the_same() -> None:
    first = job_on("first", {"hostPath": {"path": "/data/ckpt"}}, 0, status=running_status())
    for path in [
        "/data/ckpt/",
        "/data//ckpt",
        "/data/./ckpt",
        "/data/x/../ckpt",
        "/data",
        "/data/ckpt/run2",
        "/",
    ]:
        second = job_on("second", {"hostPath": {"path": path, "type": "DirectoryOrCreate"}}, created=10)
        assert creates(pass_of(second, [first, second])) == [], path
    nfs = job_on(
        "first", {"nfs": {"server": "NFS.example", "path": "/exports/ckpt/"}}, 0, status=running_status()
    )
    second = job_on(
        "second", {"nfs": {"server": "nfs.example", "path": "/exports/ckpt", "readOnly": True}}, 10
    )
    assert creates(pass_of(second, [nfs, second])) == [], "server case, trailing slash and readOnly"
    other_server = job_on("second", {"nfs": {"server": "nfs2.example", "path": "/exports/ckpt"}}, 10)
    assert len(creates(pass_of(other_server, [nfs, other_server]))) == 4
    named = job_on(
        "second", {"name": "mine", "persistentVolumeClaim": {"claimName": "shared", "readOnly": True}}, 10
    )
    assert creates(pass_of(named, [job_on("first", PVC, 0, status=running_status()), named])) == []
    assert checkpoint_dir(job_on("x", {"hostPath": {"path": "//data//ckpt/"}}, 0)) == CheckpointDir(
        "hostPath", "{}", "/data/ckpt"
    )
    csi = {"csi": {"driver": "x.csi", "volumeAttributes": {"share": "a", "dir": "b"}}}
    reordered = {
        "csi": {"volumeAttributes": {"dir": "b", "share": "a"}, "driver": "x.csi", "readOnly": False}
    }
    assert checkpoint_dir(job_on("x", csi, 0)) == checkpoint_dir(job_on("y", reordered, 0))


def test_a_finished_job_whose_workers_still_stop_keeps_its_directory() -> None:
    failed = job_on("first", PVC, 0, status={**running_status(), "phase": "Failed"})
    second = job_on("second", PVC, created=10)
    stopping = [make_pod(0, job="first", deleting=True)]
    found = claims(second, [failed, second], lambda name: stopping if name == "first" else [])
    assert [c.name for c in found] == ["first"], "a failed job's deleted workers may write a last checkpoint"
    assert creates(run(second, [], two_nodes(), checkpoint_claims=found)) == []
    ended = [make_pod(0, job="first", phase="Failed")]
    assert claims(second, [failed, second], lambda name: ended) == []


def test_a_started_job_is_never_held() -> None:
    running = job_on("second", PVC, created=10, status=running_status())
    owner = Claim("first", CheckpointDir("persistentVolumeClaim", "shared"), at(0), started=True)
    actions = run(running, [], two_nodes(), checkpoint_claims=[owner])
    assert waiting(actions) is None or waiting(actions)[0] != "CheckpointDirInUse"


def test_the_cache_fills_the_claims_and_triggers_held_jobs_when_the_owner_finishes_or_goes() -> None:
    cache = ClusterCache(None, ("ml",))  # type: ignore[arg-type]
    fired: list[tuple[str, str]] = []
    cache.trigger = lambda ns, name, urgent=False: fired.append((ns, name))
    path = "/apis/training.dtjob.io/v1alpha1/namespaces/ml/distributedtrainingjobs"
    jobs = Informer(
        None,
        "jobs in ml",
        path,
        indexes={"namespace": _namespace_of},  # type: ignore[arg-type]
        on_change=cache._job_changed,
    )
    cache.jobs = [jobs]

    def versioned(job: dict[str, Any], rv: int) -> dict[str, Any]:
        job["metadata"]["resourceVersion"] = str(rv)
        return job

    first = versioned(job_on("first", PVC, 0, status=running_status()), 1)
    held_status = {"conditions": [{"type": "Waiting", "status": "True", "reason": "CheckpointDirInUse"}]}
    second = versioned(job_on("second", PVC, 10, status=held_status), 2)
    unrelated = versioned(job_on("third", {"hostPath": {"path": "/elsewhere"}}, 20, status=held_status), 3)
    jobs._replace([first, second, unrelated], 3)

    kube = object.__new__(Kube)  # only its cache: what observe() puts in Observed.checkpoint_claims
    kube.cache = cache
    [claim] = kube._checkpoint_claims(second)
    assert (claim.name, claim.started) == ("first", True)
    assert kube._checkpoint_claims(first) == [], "a started job: not read"

    jobs._apply("MODIFIED", versioned(job_on("first", PVC, 0, status={"phase": "Running", "step": 9}), 4))
    assert fired == [], "a status change that keeps the directory live frees nothing"
    jobs._apply("MODIFIED", versioned(job_on("first", PVC, 0, status={"phase": "Succeeded"}), 5))
    assert fired == [("ml", "second")], "the owner finished: the job held on its directory is triggered"
    fired.clear()
    jobs._replace([versioned(job_on("first", PVC, 0, status=running_status()), 6), second, unrelated], 6)
    jobs._apply("DELETED", versioned(job_on("first", PVC, 0, status=running_status()), 7))
    assert fired == [("ml", "first"), ("ml", "second")], "deleted: its own pass, and the held job's"
    assert released(None, first) is False and released(first, first) is False

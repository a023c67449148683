"""docs/design.md's table "Who detects what, within which time": the one liveness model.

One setting, the job's heartbeat timeout T (spec.elastic.heartbeatTimeoutSeconds), decides every
timeout of the pods' liveness machinery: the trainer heartbeat, the pod agents and their
coordinator (contract.Liveness). The other timeouts that bear on finding a failure time
something T does not bound (the kubelet, the node controller, a trainer's start, a step's
length); each row says which (`from_t`). Every other timeout of the operator is named in
NOT_LIVENESS with what it times instead. tests/unit/test_liveness_table.py fails on a timeout of
the operator (a `*_SECONDS` constant or a `*_seconds` setting) that is in neither, so a new one
cannot stay out of the model unnoticed.
"""

from __future__ import annotations

from dataclasses import dataclass

from dtjob import contract, generated
from dtjob.api.models import ElasticPolicy
from dtjob.launcher import agent
from dtjob.operator import nodes
from dtjob.operator.settings import ObserverSettings, OperatorSettings, ReconcilerSettings

SETTING = "spec.elastic.heartbeatTimeoutSeconds"  # T, the one liveness setting


@dataclass(frozen=True)
class Detector:
    """A row of the table; `timeouts` names the operator's timeouts it states (none: in the pods)."""

    who: str
    detects: str
    within: str
    then: str
    from_t: str  # "yes: ..." (a multiple of T), or "no: " and what the time is bounded by instead
    timeouts: tuple[str, ...] = ()


# The operator's timeouts that find no failure, and what each one times.
NOT_LIVENESS: dict[str, str] = {
    "ReconcilerSettings.grow_hold_seconds": "how long a gang runs at its size before it grows",
    "ReconcilerSettings.unplanned_stop_grace_seconds": "the survivors' SIGTERM grace once a failure is found",
    "ObserverSettings.cache_sync_timeout_seconds": "the caches' first list of pods, nodes and Services",
    "RetrySettings.backoff_seconds": "the retry of a failed pass",
    "RetrySettings.backoff_max_seconds": "the retry of a failed pass",
    "OperatorSettings.interval_seconds": "kopf's per-job timer (deadlines due, jobs waiting for capacity)",
    "OperatorSettings.progress_write_seconds": "how long a status patch of progress alone may wait",
    "cache.WATCH_SECONDS": "a watch's renewal",
    "expectations.DEFAULT_GRACE_SECONDS": "the API server's default terminationGracePeriodSeconds",
    "passes.WAKE_SLACK_SECONDS": "how late a wake-up comes after the moment it names",
}


def default_timeout() -> float:
    return float(ElasticPolicy.model_fields["heartbeat_timeout_seconds"].default)


def detectors() -> list[Detector]:
    """Who finds what, within which time, from the constants that decide it (at the default T)."""
    lv = contract.Liveness(default_timeout())
    agent_t = f"{lv.AGENT_TIMEOUT_PER_T:g} T"
    rec, obs, op = ReconcilerSettings(), ObserverSettings(), OperatorSettings()
    return [
        Detector(
            "trainer heartbeat (trainer/heartbeat.py)",
            "a rank silent (hung, its pod or node cut off) or failed",
            f"T + 2 beats of min({lv.HEARTBEAT_MAX_BEAT_SECONDS:g} s, T / {lv.HEARTBEAT_BEATS_PER_TIMEOUT}) "
            f"({lv.heartbeat_verdict_seconds:g} s)",
            f"peers exit {contract.EXIT_PEER_LOST} naming it",
            "yes",
        ),
        Detector(
            "trainer collectives (process group)",
            "a collective that does not complete",
            "`--collective-timeout` of the trainer",
            "a timed-out collective waits for the heartbeat's verdict, then exits",
            "no: a step's longest collective, which T does not bound; a backstop of the heartbeat",
        ),
        Detector(
            "pod agent (launcher/agent.py)",
            "a trainer process of its pod exiting",
            f"{agent.POLL_SECONDS:g} s (poll)",
            "reports it to the coordinator",
            "no: a poll of its own children",
        ),
        Detector(
            "coordinator (launcher/coordinator.py)",
            "a pod's agent gone (pod frozen, network cut)",
            f"{agent_t} ({lv.agent_timeout_seconds:g} s; beats every "
            f"{agent_t} / {lv.AGENT_BEATS_PER_TIMEOUT}, {lv.agent_beat_seconds:g} s)",
            "no restart in place: the pods fail",
            "yes",
        ),
        Detector(
            "pod agent",
            "the coordinator gone (pod 0 frozen, network cut)",
            f"{agent_t} ({lv.agent_timeout_seconds:g} s) without an answer to its beats",
            "no restart in place: its pod fails",
            "yes",
        ),
        Detector(
            "coordinator",
            "an agent that does not stop its trainers",
            f"{lv.STOP_TIMEOUT_PER_T:g} T ({lv.stop_timeout_seconds:g} s)",
            "gives up the restart in place",
            "yes",
        ),
        Detector(
            "pod agent",
            "no answer to its failure or its stopped",
            f"{lv.ANSWER_TIMEOUT_PER_T:g} T ({lv.answer_timeout_seconds:g} s)",
            "its pod fails",
            "yes",
        ),
        Detector(
            "operator scrape (operator/scrape.py)",
            "rank 0's step, checkpoints, in-place restarts",
            f"every {obs.scrape_interval_seconds:g} s, timeout {obs.metrics_timeout_seconds:g} s, "
            f"backoff to {obs.scrape_backoff_max_seconds:g} s",
            f"status; MetricsAvailable=False after {rec.metrics_grace_seconds:g} s of none",
            "no: it reads progress and finds no failure; the grace is a trainer's start (importing "
            "torch: up to ~15 s on a loaded node)",
            (
                "ObserverSettings.scrape_interval_seconds",
                "ObserverSettings.metrics_timeout_seconds",
                "ObserverSettings.scrape_backoff_max_seconds",
                "ReconcilerSettings.metrics_grace_seconds",
            ),
        ),
        Detector(
            "operator (reconciler.py)",
            "a failed, deleted or node-lost worker",
            f"pod events, pass {op.trigger_delay_seconds:g} s later; resync {op.resync_seconds:g} s",
            "restarts the gang in new pods",
            "no: Kubernetes reports a pod's end at once; these pace the passes",
            ("OperatorSettings.trigger_delay_seconds", "OperatorSettings.resync_seconds"),
        ),
        Detector(
            "operator (suspects.py)",
            "a rank its peers named lost (exit 76)",
            "the restart's pass",
            "force-deletes its pod; new pods avoid its node until its Lease renews "
            f"(at most {nodes.SILENT_NODE_AVOID_SECONDS} s), where the others have room",
            "no: it acts on the trainers' verdict (T-derived, above) at once",
        ),
        Detector(
            "operator",
            "a deleted pod its node does not confirm (a silent node)",
            f"grace + {nodes.SILENT_KUBELET_SECONDS} s (a rank declared lost, where no room: "
            f"{nodes.LOST_RANK_GRACE_SECONDS} s + {nodes.SILENT_LOST_RANK_SECONDS} s)",
            f"force-deletes it; new pods avoid the node {nodes.SILENT_NODE_AVOID_SECONDS} s",
            "no: they time the kubelet (a deletion confirmed in 1-2 s) and the node controller (NotReady "
            f"20-50 s later; a pod bound just before is lost after {rec.node_view_lag_seconds:g} s), "
            "which no job setting changes",
            (
                "nodes.SILENT_KUBELET_SECONDS",
                "nodes.LOST_RANK_GRACE_SECONDS",
                "nodes.SILENT_LOST_RANK_SECONDS",
                "nodes.SILENT_NODE_AVOID_SECONDS",
                "ReconcilerSettings.node_view_lag_seconds",
            ),
        ),
        Detector(
            "operator",
            "a step that does not advance",
            "elastic.progressDeadlineSeconds (unset: off)",
            "restarts the gang (counted)",
            "no: a job setting of its own, a step's longest time, which T does not bound",
        ),
    ]


def intro() -> list[str]:
    """The one setting, said above the table."""
    return [
        f"T is the job's `{SETTING}` (default {default_timeout():g} s), given to every process",
        f"as `{contract.ENV_HEARTBEAT_TIMEOUT}`: every timeout of the heartbeat, the pod agents and",
        "their coordinator is a multiple of it (`contract.Liveness`; in brackets at the default).",
        "A row whose time T does not bound says what bounds it instead; the operator's numbers are",
        "its settings (`dtjob operator --help`) and the constants of operator/nodes.py.",
    ]


def table() -> list[str]:
    rows = [(d.who, d.detects, d.within, d.then, d.from_t) for d in detectors()]
    return generated.markdown_table(("Who", "Detects", "Within", "Then", "A multiple of T?"), rows)

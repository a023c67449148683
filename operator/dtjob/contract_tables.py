"""docs/design.md's tables, generated from the contract and the constants they name.

`python -m dtjob.contract_tables` rewrites the section between the markers in docs/design.md; a
unit test fails when the file differs from what this module generates (as the README's API
section, dtjob.api.docs). A constant of dtjob.contract without its row in contract.ENVIRONMENT,
EXIT_CODES or METRICS is an error here, so a new name cannot go undocumented.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from pathlib import Path

from dtjob import contract, generated
from dtjob.api.models import DEFAULT_MASTER_PORT, DEFAULT_METRICS_PORT, ElasticPolicy
from dtjob.launcher import agent
from dtjob.operator import jobview, manifests, nodes
from dtjob.operator.metrics import OperatorMetrics
from dtjob.operator.settings import ObserverSettings, OperatorSettings, ReconcilerSettings

BEGIN = "<!-- contract:begin -->"
END = "<!-- contract:end -->"
DESIGN = Path(__file__).resolve().parents[2] / "docs" / "design.md"


def _table(header: Sequence[str], rows: Iterable[Sequence[object]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _constants(prefix: str) -> dict[str, int | str]:
    """The contract's names and numbers under `prefix` (EXIT_CODES, a table, is not one)."""
    return {
        name: value
        for name, value in vars(contract).items()
        if name.startswith(prefix) and isinstance(value, int | str)
    }


def _documented(prefix: str, described: Iterable[object], table: str) -> None:
    missing = [name for name, value in _constants(prefix).items() if value not in set(described)]
    if missing:
        raise ValueError(f"dtjob.contract: {', '.join(missing)} missing from contract.{table}")


def environment() -> list[str]:
    _documented("ENV_", contract.ENVIRONMENT, "ENVIRONMENT")
    rows = [
        (f"`{name}`", who, contract.pod_env_form(name), meaning)
        for name, (who, meaning) in contract.ENVIRONMENT.items()
    ]
    return _table(("Variable", "Set by", "Form (contract.PodEnv)", "Meaning"), rows)


def exit_codes() -> list[str]:
    _documented("EXIT_", contract.EXIT_CODES, "EXIT_CODES")
    names = {value: name for name, value in _constants("EXIT_").items()}
    rows = [(code, f"`{names[code]}`", meaning) for code, meaning in sorted(contract.EXIT_CODES.items())]
    return _table(("Code", "Constant", "Meaning"), rows)


def metrics() -> list[str]:
    _documented("METRIC_", contract.METRICS, "METRICS")
    rows = [(f"`{name}`", "trainer (gauge)", meaning) for name, meaning in contract.METRICS.items()]
    collectors = OperatorMetrics().registry.collect()
    rows += [(f"`{m.name}`", f"operator ({m.type})", m.documentation) for m in collectors]
    return _table(("Metric", "Served by", "Meaning"), rows)


def ports() -> list[str]:
    op = OperatorSettings()
    liveness = op.liveness or "none"
    rows = [
        (DEFAULT_MASTER_PORT, "rank 0's pod", "rendezvous store (`MASTER_PORT`)", "spec.masterPort"),
        (
            f"{DEFAULT_MASTER_PORT} + 1",
            "pod 0",
            "the agents' coordinator (`DTJOB_AGENT_PORT`)",
            "spec.masterPort + 1",
        ),
        (
            f"{DEFAULT_METRICS_PORT} + LOCAL_RANK",
            "every trainer process",
            "Prometheus text (`DTJOB_METRICS_PORT`)",
            "spec.metricsPort",
        ),
        (op.metrics_port, "operator", "its own /metrics", "`--metrics-port`"),
        (liveness.rsplit(":", 1)[-1].split("/")[0], "operator", f"liveness ({liveness})", "`--liveness`"),
    ]
    return _table(("Port (default)", "Where", "What", "Set by"), rows)


def labels() -> list[str]:
    rows = [
        (f"`{jobview.LABEL_JOB}`", "label", "worker pods", "the job's name (the Service's selector)"),
        (f"`{jobview.LABEL_RANK}`", "label", "worker pods", "the pod's rank (DTJOB_POD_RANK)"),
        (f"`{jobview.LABEL_GENERATION}`", "label", "worker pods", "the pod's generation"),
        (f"`{jobview.LABEL_MANAGED_BY}`", "label", "worker pods", f"`{jobview.MANAGED_BY}`"),
        (f"`{manifests.PODGROUP_ANNOTATION}`", "annotation", "worker pods", "the Volcano PodGroup (gang)"),
        (f"`{jobview.FINALIZER}`", "finalizer", "jobs", "kopf's: the per-job timer needs one"),
    ]
    return _table(("Name", "Kind", "On", "Value"), rows)


SETTING = "spec.elastic.heartbeatTimeoutSeconds"  # T, the one liveness setting


def liveness_intro() -> list[str]:
    """The one setting the in-pod timeouts derive from, said above the table."""
    default = ElasticPolicy.model_fields["heartbeat_timeout_seconds"].default
    return [
        f"T is the job's `{SETTING}` (default {default} s), given to every process",
        f"as `{contract.ENV_HEARTBEAT_TIMEOUT}`: every timeout inside the pods is a multiple of it",
        "(`contract.Liveness`; in brackets at the default). The operator's timeouts are its own",
        "settings (`dtjob operator --help`).",
    ]


def liveness() -> list[str]:
    """Who finds what, within which time, from the constants that decide it."""
    T = ElasticPolicy.model_fields["heartbeat_timeout_seconds"].default
    lv = contract.Liveness(float(T))
    agent_t = f"{lv.AGENT_TIMEOUT_PER_T:g} T"
    rec, obs, op = ReconcilerSettings(), ObserverSettings(), OperatorSettings()
    rows = [
        (
            "trainer heartbeat (trainer/heartbeat.py)",
            "a rank silent (hung, its pod or node cut off) or failed",
            f"T + 2 beats of min({lv.HEARTBEAT_MAX_BEAT_SECONDS:g} s, T / {lv.HEARTBEAT_BEATS_PER_TIMEOUT}) "
            f"({lv.heartbeat_verdict_seconds:g} s)",
            f"peers exit {contract.EXIT_PEER_LOST} naming it",
        ),
        (
            "pod agent (launcher/agent.py)",
            "a trainer process of its pod exiting",
            f"{agent.POLL_SECONDS:g} s (poll)",
            "reports it to the coordinator",
        ),
        (
            "coordinator (launcher/coordinator.py)",
            "a pod's agent gone (pod frozen, network cut)",
            f"{agent_t} ({lv.agent_timeout_seconds:g} s; beats every "
            f"{agent_t} / {lv.AGENT_BEATS_PER_TIMEOUT}, {lv.agent_beat_seconds:g} s)",
            "no restart in place: the pods fail",
        ),
        (
            "pod agent",
            "the coordinator gone (pod 0 frozen, network cut)",
            f"{agent_t} ({lv.agent_timeout_seconds:g} s) without an answer to its beats",
            "no restart in place: its pod fails",
        ),
        (
            "coordinator",
            "an agent that does not stop its trainers",
            f"{lv.STOP_TIMEOUT_PER_T:g} T ({lv.stop_timeout_seconds:g} s)",
            "gives up the restart in place",
        ),
        (
            "pod agent",
            "no answer to its failure or its stopped",
            f"{lv.ANSWER_TIMEOUT_PER_T:g} T ({lv.answer_timeout_seconds:g} s)",
            "its pod fails",
        ),
        (
            "operator scrape (operator/scrape.py)",
            "rank 0's step, checkpoints, in-place restarts",
            f"every {obs.scrape_interval_seconds:g} s, timeout {obs.metrics_timeout_seconds:g} s, "
            f"backoff to {obs.scrape_backoff_max_seconds:g} s",
            f"status; MetricsAvailable=False after {rec.metrics_grace_seconds:g} s of none",
        ),
        (
            "operator (reconciler.py)",
            "a failed, deleted or node-lost worker",
            f"pod events, pass {op.trigger_delay_seconds:g} s later; resync {op.resync_seconds:g} s",
            "restarts the gang in new pods",
        ),
        (
            "operator (suspects.py)",
            "a rank its peers named lost (exit 76)",
            "the restart's pass",
            "force-deletes its pod; new pods avoid its node until its Lease renews "
            f"(at most {nodes.SILENT_NODE_AVOID_SECONDS} s), where the others have room",
        ),
        (
            "operator",
            "a deleted pod its node does not confirm (a silent node)",
            f"grace + {nodes.SILENT_KUBELET_SECONDS} s (a rank declared lost, where no room: "
            f"{nodes.LOST_RANK_GRACE_SECONDS} s + {nodes.SILENT_LOST_RANK_SECONDS} s)",
            f"force-deletes it; new pods avoid the node {nodes.SILENT_NODE_AVOID_SECONDS} s",
        ),
        (
            "operator",
            "a step that does not advance",
            "elastic.progressDeadlineSeconds (unset: off)",
            "restarts the gang (counted)",
        ),
    ]
    return _table(("Who", "Detects", "Within", "Then"), rows)


def contract_section() -> str:
    parts = [
        "<!-- generated by `python -m dtjob.contract_tables`; do not edit -->",
        "",
        "### Who detects what, within which time",
        "",
        *liveness_intro(),
        "",
        *liveness(),
        "",
        "### Environment of every trainer process",
        "",
        *environment(),
        "",
        "### Exit codes",
        "",
        *exit_codes(),
        "",
        "### Metrics",
        "",
        *metrics(),
        "",
        "### Ports",
        "",
        *ports(),
        "",
        "### Labels, annotations, finalizer",
        "",
        *labels(),
    ]
    return "\n".join(parts)


def with_contract_section(text: str) -> str:
    """`text` with the section between the markers replaced (appended if absent)."""
    return generated.replace_between(text, BEGIN, END, contract_section())


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m dtjob.contract_tables  (rewrites docs/design.md's tables)", file=sys.stderr)
        return 2
    DESIGN.write_text(with_contract_section(DESIGN.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""What a restarted nodelet does with the pods an earlier run left: which count as started, and
the NodeLost status they get."""

from __future__ import annotations

from pathlib import Path

from dtjob.devcluster.nodelet.manager import lost_status, was_started
from dtjob.devcluster.nodelet.pods import FALLBACK_LOG_BYTES, FALLBACK_LOG_LINES, fallback_message, security


def test_a_pod_counts_as_started_once_it_had_an_ip_or_a_container_state() -> None:
    assert not was_started({"status": {"phase": "Pending"}})
    waiting = {"state": {"waiting": {"reason": "ContainerCreating"}}}
    assert not was_started({"status": {"phase": "Pending", "containerStatuses": [waiting]}})
    assert was_started({"status": {"phase": "Pending", "podIP": "10.244.1.2"}})
    assert was_started({"status": {"phase": "Running"}})
    done = {"state": {"terminated": {"exitCode": 0}}}
    assert was_started({"status": {"phase": "Pending", "initContainerStatuses": [done]}})


def test_lost_pods_fail_with_node_lost_and_unknown_containers() -> None:
    pod = {
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {"name": "a", "ready": True, "state": {"running": {"startedAt": "t"}}},
                {
                    "name": "b",
                    "ready": False,
                    "state": {"terminated": {"exitCode": 0, "reason": "Completed"}},
                },
            ],
        }
    }
    st = lost_status(pod)
    assert (st["phase"], st["reason"]) == ("Failed", "NodeLost")
    a, b = st["containerStatuses"]
    assert (
        a["state"]["terminated"]["exitCode"] == 137
        and a["state"]["terminated"]["reason"] == "ContainerStatusUnknown"
    )
    assert not a["ready"] and b["state"] == {"terminated": {"exitCode": 0, "reason": "Completed"}}
    assert {c["type"]: c["status"] for c in st["conditions"]} == {
        "ContainersReady": "False",
        "Ready": "False",
    }


def test_container_security_context_overrides_the_pod_and_fs_group_joins_the_groups() -> None:
    pod = {"spec": {"securityContext": {"runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 2000}}}
    assert security(pod, {"securityContext": {"runAsUser": 1001}}) == {
        "runAsUser": 1001,
        "runAsGroup": 1000,
        "supplementalGroups": [2000],
    }
    assert security({"spec": {}}, {}) == {"runAsUser": None, "runAsGroup": None, "supplementalGroups": []}


def test_a_failed_container_under_fallback_to_logs_gets_its_log_tail_as_message(tmp_path: Path) -> None:
    log = tmp_path / "0.log"
    log.write_text("".join(f"line {i}\n" for i in range(200)) + "ValueError: bad\n")
    fallback = {"terminationMessagePolicy": "FallbackToLogsOnError"}
    message = fallback_message(fallback, log)
    assert message.endswith("line 199\nValueError: bad")
    assert len(message.splitlines()) <= FALLBACK_LOG_LINES and len(message.encode()) <= FALLBACK_LOG_BYTES
    assert fallback_message({}, log) == "", "policy File (the default): the nodelet writes no message"
    assert fallback_message(fallback, tmp_path / "missing.log") == ""

"""The helm chart on the devcluster: the operator runs as the chart's pod, under the chart's
ServiceAccount and RBAC, and nothing else.

The nodelet runs the operator pod's command (`dtjob operator ...`) as a local process with the
projected ServiceAccount token, so every API call the operator makes is authorized by the chart's
RBAC. The tests share one release, in this order:

1. `helm install` restricted to one namespace; the job NOTES.txt tells a new user to apply runs
   to Succeeded (or the test prints the job's conditions, events and worker logs). A worker that
   fails puts its exit code and last log line on the job's condition and event.
2. That install cannot see or touch a job in another namespace.
3. With any one rule removed from the operator's roles, the behaviour the rule is for fails,
   and the operator's log shows the API server refusing the call.
4. `helm upgrade --set volcano.enabled=true` grants the PodGroup rule a Volcano job was refused.
5. `helm upgrade` to an all-namespaces install: the job in the other namespace is served now.
6. `helm uninstall` leaves the CRD and no operator resource.

The release starts namespaced so that, while it runs, it never touches jobs of other test
sessions sharing the devcluster; the all-namespaces phase is kept short.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.e2e.conftest import (
    Devcluster,
    apply_crd,
    helm,
    job_diagnostics,
    kubectl,
    kubectl_json,
    volcano_podgroup_crd,
    wait_for,
    wait_for_phase,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "dtjob"
RELEASE = "dtjob-helm"  # contains the chart's name, so the chart names its objects RELEASE
SYSTEM_NS = "dtjob-helm-system"
JOBS_NS = "dtjob-helm-jobs"
OTHER_NS = "dtjob-helm-other"
OPERATOR_SA = f"system:serviceaccount:{SYSTEM_NS}:{RELEASE}"
JOB_LABEL = "training.dtjob.io/job-name"
# A working operator creates a job's Service and pods within a second or two of the job (test 1
# prints its timings); a broken one gets this long to show that it cannot.
BROKEN_WINDOW_SECONDS = 15.0
# Workers of the RBAC tests only need to exist, not to train: a sleeping process is enough and
# leaves the 2 cores to the operator.
SLEEPER = ["python", "-c", "import time; time.sleep(600)"]


def install_args() -> list[str]:
    return [str(CHART), "--namespace", SYSTEM_NS, "--wait", "--timeout", "180s"]


def _dedent(text: str) -> str:
    lines = text.splitlines()
    indent = min(len(line) - len(line.lstrip()) for line in lines if line.strip())
    return "\n".join(line[indent:] for line in lines)


def notes_job() -> tuple[dict[str, Any], str]:
    """The first job of the release's NOTES (as `helm get notes` prints them) and the namespace
    the notes tell the user to apply it to."""
    notes = helm("get", "notes", RELEASE, "--namespace", SYSTEM_NS, check=True).stdout
    match = re.search(r"kubectl apply -n (\S+) -f - *\n(.*?)\n\s*YAML\n", notes, re.S)
    assert match, f"no job manifest in the release notes:\n{notes}"
    return yaml.safe_load(_dedent(match.group(2))), match.group(1)


def small_job(name: str, command: list[str] | None = None) -> dict[str, Any]:
    """The NOTES job, renamed, with 8 steps (or another command): quick on 2 shared cores."""
    job, _ = notes_job()
    job["metadata"]["name"] = name
    container = job["spec"]["template"]["spec"]["containers"][0]
    container["args"] = [a for a in container["args"] if not a.startswith("--steps")] + [
        "--steps=8",
        "--global-batch-size=4",
    ]
    if command is not None:
        container["command"], container["args"] = command, []
    return job


def apply(obj: dict[str, Any], namespace: str) -> None:
    kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(obj), check=True)


def get_job(namespace: str, name: str) -> dict[str, Any] | None:
    result = kubectl("get", "dtj", name, "-n", namespace, "-o", "json")
    return json.loads(result.stdout) if result.returncode == 0 else None


def phase(namespace: str, name: str) -> str | None:
    job = get_job(namespace, name)
    return None if job is None else (job.get("status") or {}).get("phase")


def worker_pods(namespace: str, name: str) -> list[dict[str, Any]]:
    return list(kubectl_json("get", "pods", "-n", namespace, "-l", f"{JOB_LABEL}={name}")["items"])


def service_exists(namespace: str, name: str) -> bool:
    return kubectl("get", "service", name, "-n", namespace).returncode == 0


def job_events(namespace: str, name: str) -> list[dict[str, Any]]:
    selector = f"involvedObject.kind=DistributedTrainingJob,involvedObject.name={name}"
    return list(kubectl_json("get", "events", "-n", namespace, "--field-selector", selector)["items"])


def untouched(namespace: str, name: str) -> bool:
    """No status, no finalizer, no Service, no pod: no operator has acted on the job."""
    job = get_job(namespace, name)
    assert job is not None, f"job {namespace}/{name} is gone"
    return (
        not job.get("status")
        and not job["metadata"].get("finalizers")
        and not service_exists(namespace, name)
        and not worker_pods(namespace, name)
    )


def delete_job(namespace: str, name: str) -> None:
    """Deletes a job without waiting for an operator that may be unable to finish it: the job is
    marked deleted first (so kopf adds no finalizer again), then its finalizer is dropped."""
    kubectl("delete", "dtj", name, "-n", namespace, "--ignore-not-found", "--wait=false", check=True)
    kubectl("patch", "dtj", name, "-n", namespace, "--type=merge", "-p", '{"metadata":{"finalizers":null}}')
    wait_for(f"job {namespace}/{name} to go", lambda: get_job(namespace, name) is None, timeout=120)
    kubectl(
        "delete", "pods", "-n", namespace, "-l", f"{JOB_LABEL}={name}", "--grace-period=1", "--wait=false"
    )


def operator_pod() -> dict[str, Any]:
    pods = kubectl_json("get", "pods", "-n", SYSTEM_NS, "-l", "app.kubernetes.io/component=operator")["items"]
    live = [
        p
        for p in pods
        if p["status"].get("phase") == "Running" and not p["metadata"].get("deletionTimestamp")
    ]
    assert len(live) == 1, [(p["metadata"]["name"], p["status"].get("phase")) for p in pods]
    return dict(live[0])


def operator_logs() -> str:
    name = operator_pod()["metadata"]["name"]
    return kubectl("logs", "-n", SYSTEM_NS, name, "--tail=300", check=True).stdout


def wait_for_log(pattern: str) -> None:
    """The operator's log shows `pattern` (polled: the nodelet serves logs a moment late)."""
    deadline = time.monotonic() + 90
    log = ""
    while time.monotonic() < deadline:
        log = operator_logs()
        if re.search(pattern, log):
            return
        time.sleep(0.5)
    tail = "\n".join(log.splitlines()[-40:])
    pytest.fail(f"timed out after 90s waiting for the operator's log to show {pattern!r}; its end:\n{tail}")


def http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def can_i(verb: str, resource: str, namespace: str | None = None) -> bool:
    """Whether the operator's ServiceAccount may; namespace "*" means in every namespace."""
    scope = ["--all-namespaces"] if namespace == "*" else ["-n", namespace] if namespace else []
    return kubectl("auth", "can-i", verb, resource, *scope, f"--as={OPERATOR_SA}").stdout.strip() == "yes"


def holds_for(what: str, predicate: Callable[[], bool], seconds: float) -> None:
    """Fails the test as soon as predicate stops holding within the window."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert predicate(), f"{what} stopped holding"
        time.sleep(0.5)


@pytest.fixture(scope="module")
def release(devcluster: Devcluster) -> Iterator[None]:
    # An earlier run's leftovers (its namespaces may still be terminating).
    helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait", timeout=300)
    kubectl(
        "delete", "namespace", JOBS_NS, OTHER_NS, SYSTEM_NS, "--ignore-not-found", "--wait=true", timeout=180
    )
    for namespace in (JOBS_NS, OTHER_NS):
        kubectl("create", "namespace", namespace)
    helm(
        "install",
        RELEASE,
        *install_args(),
        "--create-namespace",
        "--set",
        f"watchNamespaces={{{JOBS_NS}}}",
        check=True,
        timeout=300,
    )
    try:
        yield
    finally:
        helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait", timeout=300)
        for namespace in (JOBS_NS, OTHER_NS, SYSTEM_NS):
            kubectl("delete", "namespace", namespace, "--wait=false")


def test_install_runs_the_first_job_from_the_notes_to_succeeded(release: None) -> None:
    pod = operator_pod()
    assert pod["spec"]["serviceAccountName"] == RELEASE
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["dtjob", "operator"]
    assert f"--namespace={JOBS_NS}" in container["args"]

    # The ports the chart gives the operator: liveness answers, metrics are served, and the
    # metrics Service's endpoints are this pod.
    ip = pod["status"]["podIP"]
    wait_for("the operator's liveness endpoint", lambda: http_ok(f"http://{ip}:8080/healthz"), timeout=60)
    with urllib.request.urlopen(f"http://{ip}:9401/metrics", timeout=10) as metrics:
        assert "dtjob_operator_jobs" in metrics.read().decode()

    def metrics_endpoints() -> list[tuple[str, int]]:
        selector = f"kubernetes.io/service-name={RELEASE}-metrics"
        slices = kubectl_json("get", "endpointslices", "-n", SYSTEM_NS, "-l", selector)["items"]
        return [
            (address, port["port"])
            for sl in slices
            for endpoint in sl.get("endpoints") or []
            for address in endpoint["addresses"]
            for port in sl.get("ports") or []
        ]

    wait_for(
        "the metrics Service to point at the pod", lambda: metrics_endpoints() == [(ip, 9401)], timeout=30
    )

    job, namespace = notes_job()
    assert namespace == JOBS_NS, "the notes should send the first job to the watched namespace"
    name = job["metadata"]["name"]
    apply(small_job(name), namespace)
    started = time.monotonic()
    wait_for("the job's two worker pods", lambda: len(worker_pods(namespace, name)) == 2, timeout=120)
    to_pods = time.monotonic() - started
    assert service_exists(namespace, name)
    # The chart's worker defaults (workers.* values) reached the pods through the operator, and
    # the workers' ServiceAccount may do nothing.
    worker = worker_pods(namespace, name)[0]["spec"]
    assert worker["serviceAccountName"] == f"{RELEASE}-worker"
    assert worker["automountServiceAccountToken"] is False
    assert worker["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    worker_sa = f"system:serviceaccount:{namespace}:{RELEASE}-worker"
    for verb, resource in [("get", "pods"), ("list", "distributedtrainingjobs"), ("create", "events")]:
        assert (
            kubectl("auth", "can-i", verb, resource, "-n", namespace, f"--as={worker_sa}").stdout.strip()
            == "no"
        )
    wait_for_phase(namespace, name, "Succeeded", timeout=240)
    total = time.monotonic() - started
    print(f"\nhelm e2e: worker pods {to_pods:.1f}s after the job, Succeeded after {total:.1f}s")
    assert job_events(namespace, name), "the operator recorded no Event on the job"
    delete_job(namespace, name)


def test_a_failed_worker_says_its_exit_code_and_last_line_on_the_job(release: None) -> None:
    # Exit 2 is permanent by default (EXIT_CONFIG_ERROR): the job fails at once, and its condition
    # and event quote the worker's last log line (FallbackToLogsOnError, issue #46).
    name = "says-why"
    script = "import sys; print('loading data'); print('no such corpus: /data/x', flush=True); sys.exit(2)"
    apply(small_job(name, ["python", "-c", script]), JOBS_NS)
    try:
        wait_for_phase(JOBS_NS, name, "Failed", timeout=120)
        said = "failed (exit code 2): no such corpus: /data/x"
        job = get_job(JOBS_NS, name) or {}
        failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
        assert said in failed["message"], job_diagnostics(JOBS_NS, name)
        assert any(said in e["message"] for e in job_events(JOBS_NS, name)), job_diagnostics(JOBS_NS, name)
    finally:
        delete_job(JOBS_NS, name)


def test_namespaced_install_cannot_see_or_touch_another_namespace(release: None) -> None:
    # RBAC: everything it needs in its namespace, nothing in another, only nodes cluster-wide.
    assert can_i("create", "pods", JOBS_NS) and can_i("watch", "distributedtrainingjobs", JOBS_NS)
    assert can_i("list", "nodes") and not can_i("patch", "nodes")
    for verb, resource in [
        ("list", "distributedtrainingjobs"),
        ("patch", "distributedtrainingjobs"),
        ("create", "pods"),
        ("create", "events"),
        ("get", "secrets"),
    ]:
        assert not can_i(verb, resource, OTHER_NS), f"{verb} {resource} in {OTHER_NS}"
        assert not can_i(verb, resource, "*"), f"{verb} {resource} in every namespace"
    name = "elsewhere"
    apply(small_job(name, SLEEPER), OTHER_NS)
    try:
        holds_for(
            f"job {OTHER_NS}/{name} untouched", lambda: untouched(OTHER_NS, name), BROKEN_WINDOW_SECONDS
        )
    finally:
        delete_job(OTHER_NS, name)


def _role_with_rule(resource: str) -> tuple[str, dict[str, Any]]:
    """The kind/name and object of the operator's role holding the rule on `resource`."""
    candidates = [("clusterrole", f"{RELEASE}-nodes", None), ("role", RELEASE, JOBS_NS)]
    for kind, name, namespace in candidates:
        scope = ["-n", namespace] if namespace else []
        role = kubectl_json("get", kind, name, *scope)
        if any(resource in rule["resources"] for rule in role["rules"]):
            return kind, role
    raise AssertionError(f"no role of the release has a rule on {resource}")


def _remove_rule(resource: str) -> Callable[[], None]:
    """Removes the rule on `resource` from the operator's role; returns the undo."""
    _, role = _role_with_rule(resource)
    original = json.loads(json.dumps(role))
    kept = [rule for rule in role["rules"] if resource not in rule["resources"]]
    assert len(kept) == len(role["rules"]) - 1
    role["rules"] = kept
    kubectl("replace", "-f", "-", input=json.dumps(role), check=True)

    def restore() -> None:
        original["metadata"].pop("resourceVersion", None)
        kubectl("replace", "-f", "-", input=json.dumps(original), check=True)

    return restore


def _denied(resource: str) -> str:
    """The API server's words when RBAC refuses a call on `resource`."""
    return rf'cannot \w+ resource \\?"{re.escape(resource)}\\?"'


def restart_operator() -> None:
    """Replaces the operator pod: a new process starts its watches under the roles as they are
    now (a running watch was authorized once, when it started)."""
    old = operator_pod()["metadata"]["name"]
    # A second's grace: an operator without its peering rule is stuck in kopf's retries.
    kubectl("delete", "pod", old, "-n", SYSTEM_NS, "--grace-period=1", "--wait=true", check=True)

    def replaced() -> bool:
        try:
            return operator_pod()["metadata"]["name"] != old
        except AssertionError:
            return False

    wait_for("a new operator pod", replaced, timeout=90)


# Each rule of the roles -> what a job shows without it (for BROKEN_WINDOW_SECONDS), and what the
# operator logs about the refused call. Events are the exception: the job proceeds, silently.
RULES: dict[str, tuple[Callable[[str], bool], str]] = {
    "distributedtrainingjobs": (lambda n: untouched(JOBS_NS, n), _denied("distributedtrainingjobs")),
    "distributedtrainingjobs/status": (
        lambda n: phase(JOBS_NS, n) is None,
        _denied("distributedtrainingjobs/status"),
    ),
    "pods": (lambda n: not worker_pods(JOBS_NS, n), _denied("pods")),
    "services": (
        lambda n: not service_exists(JOBS_NS, n) and not worker_pods(JOBS_NS, n),
        _denied("services"),
    ),
    "events": (lambda n: not job_events(JOBS_NS, n), r"could not post event \w+ on [^\n]*Forbidden"),
    "nodes": (lambda n: phase(JOBS_NS, n) is None and not worker_pods(JOBS_NS, n), _denied("nodes")),
    # kopf pauses every handler until it has checked in with its peers, so nothing happens; kopf
    # does not always log why, so the operator checks at startup (peering.py) and says it.
    "kopfpeerings": (
        lambda n: untouched(JOBS_NS, n),
        _denied("kopfpeerings") + r".* the operator's role needs get, list, watch and patch on kopfpeerings",
    ),
}
# kopf lists and watches the peering object once, at start, and the operator's caches its nodes
# and its jobs: those rules show on a new process (a running watch was authorized once, when it
# started; the rules on pods and Services show at once, on the creates they also hold).
NEEDS_RESTART = {"kopfpeerings", "nodes", "distributedtrainingjobs"}


@pytest.mark.parametrize("resource", list(RULES))
def test_without_any_one_rule_the_operator_fails(release: None, resource: str) -> None:
    broken, logged = RULES[resource]
    name = "no-" + resource.replace("distributedtrainingjobs", "dtj").replace("/", "-")
    restore = _remove_rule(resource)
    try:
        if resource in NEEDS_RESTART:
            restart_operator()
        # Let the API server's RBAC cache see the role as it is now.
        time.sleep(3)
        apply(small_job(name, SLEEPER), JOBS_NS)
        if resource == "events":
            # The job goes on without its Events: pods appear, the job's history stays empty.
            wait_for("the worker pods", lambda: len(worker_pods(JOBS_NS, name)) == 2, timeout=120)
        holds_for(f"job without the {resource} rule broken", lambda: broken(name), BROKEN_WINDOW_SECONDS)
        wait_for_log(logged)
    finally:
        restore()
        delete_job(JOBS_NS, name)
        if resource in NEEDS_RESTART:
            restart_operator()


def test_volcano_podgroups_need_the_volcano_value(release: None) -> None:
    """volcano.enabled=false (the default) grants no PodGroup rights: a Volcano job gets no
    PodGroup. `helm upgrade --set volcano.enabled=true` adds the rule, and the operator's next
    pass creates it."""
    crd = volcano_podgroup_crd()
    apply_crd(crd)
    name = "gang"
    job = small_job(name, SLEEPER)
    job["spec"]["scheduling"] = {"schedulerName": "volcano"}

    def podgroup_exists() -> bool:
        return kubectl("get", "podgroups.scheduling.volcano.sh", name, "-n", JOBS_NS).returncode == 0

    apply(job, JOBS_NS)
    try:
        holds_for("no PodGroup without volcano.enabled", lambda: not podgroup_exists(), BROKEN_WINDOW_SECONDS)
        wait_for_log(_denied("podgroups"))
        helm(
            "upgrade",
            RELEASE,
            *install_args(),
            "--reuse-values",
            "--set",
            "volcano.enabled=true",
            check=True,
            timeout=300,
        )
        assert can_i("create", "podgroups.scheduling.volcano.sh", JOBS_NS)
        # The refused call fails the pass, which is retried with backoff (at most 30 s apart).
        wait_for("the PodGroup, created under the upgraded role", podgroup_exists, timeout=150)
    finally:
        delete_job(JOBS_NS, name)


def test_upgrade_to_all_namespaces_serves_the_other_namespace(release: None) -> None:
    name = "seen-after-upgrade"
    apply(small_job(name, SLEEPER), OTHER_NS)
    try:
        helm(
            "upgrade",
            RELEASE,
            *install_args(),
            "--reuse-values",
            "--set-json",
            "watchNamespaces=[]",
            check=True,
            timeout=300,
        )
        args = operator_pod()["spec"]["containers"][0]["args"]
        assert "--all-namespaces" in args and not [a for a in args if a.startswith("--namespace")]
        assert kubectl("get", "role", RELEASE, "-n", JOBS_NS).returncode != 0
        assert kubectl("get", "clusterkopfpeering", RELEASE).returncode == 0
        assert can_i("create", "pods", "*") and can_i("list", "distributedtrainingjobs", "*")
        wait_for(
            "the other namespace's job served", lambda: len(worker_pods(OTHER_NS, name)) == 2, timeout=120
        )
    finally:
        delete_job(OTHER_NS, name)


def test_uninstall_keeps_the_crd_and_removes_every_operator_resource(release: None) -> None:
    helm("uninstall", RELEASE, "--namespace", SYSTEM_NS, "--wait", check=True, timeout=300)
    assert kubectl("get", "crd", "distributedtrainingjobs.training.dtjob.io").returncode == 0
    selector = f"app.kubernetes.io/instance={RELEASE}"
    kinds = "deployments,pods,services,serviceaccounts,roles,rolebindings,kopfpeerings"
    wait_for(
        "the operator's pods and namespaced objects to go",
        lambda: kubectl("get", kinds, "-A", "-l", selector, "-o", "name", check=True).stdout.strip() == "",
        timeout=120,
    )
    cluster_kinds = "clusterroles,clusterrolebindings,clusterkopfpeerings"
    assert kubectl("get", cluster_kinds, "-l", selector, "-o", "name", check=True).stdout.strip() == ""

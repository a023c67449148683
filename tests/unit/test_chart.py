"""The helm chart, rendered and linted by the real helm binary (no cluster needed).

Checks that `helm lint` / `helm template` pass for an all-namespaces and a namespaced install,
that wrong values are refused with a message naming the key, what the rendered objects contain
(security context, RBAC scope, operator arguments), and that the chart's CRD is the generated one.
"""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from dtjob.devcluster.binaries import Binaries

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "helm" / "dtjob"
CRD_FILE = "training.dtjob.io_distributedtrainingjobs.yaml"
NAMESPACED = ["--set", "watchNamespaces={team-a,team-b}"]


def helm_binary() -> Path:
    helm = Binaries.pinned().path("helm")
    assert helm.is_file(), f"{helm} is missing: run `make binaries` (devcluster/build-binaries.sh)"
    return helm


def helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(helm_binary()), *args], capture_output=True, text=True, timeout=60)


def render(*extra: str) -> list[dict[str, Any]]:
    result = helm("template", "rel", str(CHART), "--namespace", "dtjob-system", *extra)
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def only(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, got {[d['metadata'] for d in found]}"
    return found[0]


def operator_container(docs: list[dict[str, Any]]) -> dict[str, Any]:
    containers = only(docs, "Deployment")["spec"]["template"]["spec"]["containers"]
    assert [c["name"] for c in containers] == ["operator"]
    return dict(containers[0])


@pytest.mark.parametrize("values", [[], NAMESPACED], ids=["all-namespaces", "namespaced"])
def test_helm_lint_passes(values: list[str]) -> None:
    result = helm("lint", "--strict", str(CHART), *values)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 chart(s) failed" in result.stdout


def test_default_install_is_cluster_wide() -> None:
    docs = render()
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(
        [
            "ServiceAccount",
            "ClusterRole",
            "ClusterRoleBinding",
            "Service",
            "Deployment",
            "ClusterKopfPeering",
            "Role",
            "RoleBinding",
        ]
    )
    args = operator_container(docs)["args"]
    assert "--all-namespaces" in args
    assert not [a for a in args if a.startswith("--namespace")]
    binding = only(docs, "ClusterRoleBinding")
    assert binding["roleRef"]["name"] == only(docs, "ClusterRole")["metadata"]["name"]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-dtjob", "namespace": "dtjob-system"}
    ]
    assert f"--peering={only(docs, 'ClusterKopfPeering')['metadata']['name']}" in args


def test_namespaced_install_has_a_role_per_namespace_and_reads_only_nodes_cluster_wide() -> None:
    docs = render(*NAMESPACED)
    args = operator_container(docs)["args"]
    assert "--all-namespaces" not in args
    assert [a for a in args if a.startswith("--namespace")] == ["--namespace=team-a", "--namespace=team-b"]
    for kind in ("Role", "RoleBinding"):
        namespaces = sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == kind)
        assert namespaces == ["kube-node-lease", "team-a", "team-b"]
    peerings = sorted(d["metadata"]["namespace"] for d in docs if d["kind"] == "KopfPeering")
    assert peerings == ["team-a", "team-b"]
    assert not [d for d in docs if d["kind"] == "ClusterKopfPeering"]
    # The only cluster-wide grant: reading nodes.
    cluster_role = only(docs, "ClusterRole")
    assert cluster_role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["list", "watch"]}]
    role_resources = {
        r for d in docs if d["kind"] == "Role" for rule in d["rules"] for r in rule["resources"]
    }
    assert {"distributedtrainingjobs", "pods", "events", "services", "kopfpeerings"} <= role_resources
    # Workers get a ServiceAccount (no binding refers to it) in every watched namespace.
    workers = [
        d for d in docs if d["kind"] == "ServiceAccount" and d["metadata"]["name"] == "rel-dtjob-worker"
    ]
    assert sorted(w["metadata"]["namespace"] for w in workers) == ["team-a", "team-b"]
    assert all(w["automountServiceAccountToken"] is False for w in workers)
    bound = [s["name"] for d in docs if d["kind"].endswith("Binding") for s in d["subjects"]]
    assert "rel-dtjob-worker" not in bound


def test_rbac_grants_no_wildcards_no_secrets_and_nodes_read_only() -> None:
    for values in ([], NAMESPACED, ["--set", "volcano.enabled=true"]):
        docs = render(*values)
        rules = [rule for d in docs if d["kind"] in ("Role", "ClusterRole") for rule in d["rules"]]
        for rule in rules:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"], rule
            assert not {"secrets", "configmaps", "namespaces"} & set(rule["resources"]), rule
            assert not {"update", "deletecollection", "escalate", "bind", "impersonate"} & set(
                rule["verbs"]
            ), rule
            if "nodes" in rule["resources"]:
                assert rule["verbs"] == ["list", "watch"]


@pytest.mark.parametrize("values", [[], NAMESPACED], ids=["all-namespaces", "namespaced"])
def test_node_leases_are_read_one_by_one_in_kube_node_lease_only(values: list[str]) -> None:
    docs = render(*values)
    [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"]["namespace"] == "kube-node-lease"]
    get_leases = {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["get"]}
    assert role["rules"] == [get_leases]
    [binding] = [
        d for d in docs if d["kind"] == "RoleBinding" and d["metadata"]["namespace"] == "kube-node-lease"
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    operator = {"kind": "ServiceAccount", "name": "rel-dtjob", "namespace": "dtjob-system"}
    assert binding["subjects"] == [operator]
    leases = [r for d in docs if d["kind"].endswith("Role") for r in d["rules"] if "leases" in r["resources"]]
    assert leases == role["rules"], "no other grant on leases, nowhere else"


def test_volcano_podgroups_are_granted_only_when_enabled() -> None:
    def podgroup_rules(*values: str) -> list[dict[str, Any]]:
        docs = render(*values)
        return [
            r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"] if "podgroups" in r["resources"]
        ]

    assert podgroup_rules() == []
    (rule,) = podgroup_rules("--set", "volcano.enabled=true")
    assert rule["apiGroups"] == ["scheduling.volcano.sh"]
    assert rule["verbs"] == ["get", "create", "patch"]
    for values in ([], NAMESPACED):
        docs = render(*values, "--set", "volcano.enabled=true")
        queues = [
            r for d in docs if d["kind"] == "ClusterRole" for r in d["rules"] if "queues" in r["resources"]
        ]
        assert queues == [{"apiGroups": ["scheduling.volcano.sh"], "resources": ["queues"], "verbs": ["get"]}]


def test_deployment_is_one_hardened_recreated_replica() -> None:
    docs = render()
    deployment = only(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    pod = deployment["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == only(docs, "ServiceAccount")["metadata"]["name"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    container = operator_container(docs)
    assert container["command"] == ["dtjob", "operator"]
    security = container["securityContext"]
    assert security["runAsNonRoot"] is True
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security["capabilities"] == {"drop": ["ALL"]}
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    assert container["resources"]["requests"] and container["resources"]["limits"]
    # /tmp is the one writable place, an emptyDir.
    assert container["volumeMounts"] == [{"name": "tmp", "mountPath": "/tmp"}]
    assert pod["volumes"][0]["name"] == "tmp" and "emptyDir" in pod["volumes"][0]
    # The liveness probe hits the port the operator is told to serve its health endpoint on.
    probe = container["livenessProbe"]["httpGet"]
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert probe["path"] == "/healthz" and probe["port"] == "health"
    assert f"--liveness=http://0.0.0.0:{ports['health']}/healthz" in container["args"]
    assert f"--metrics-port={ports['metrics']}" in container["args"]


TUNED = [
    "--set",
    "operator.verbose=true,peering.priority=7,operator.maxWorkers=4",
    "--set-json",
    "operator.interval=2.5",
]


@pytest.mark.parametrize("values", [[], NAMESPACED, TUNED], ids=["all-namespaces", "namespaced", "tuned"])
def test_operator_accepts_the_arguments_the_chart_passes(values: list[str]) -> None:
    from dtjob.operator.main import parse_args

    docs = render(*values)
    args = parse_args(operator_container(docs)["args"])
    assert args.namespace == (["team-a", "team-b"] if values == NAMESPACED else [])
    assert args.all_namespaces is (values != NAMESPACED)
    peering_kind = "KopfPeering" if args.namespace else "ClusterKopfPeering"
    assert {args.peering} == {d["metadata"]["name"] for d in docs if d["kind"] == peering_kind}
    assert args.standalone is False
    expected = (True, 2.5, 7, 4) if values == TUNED else (False, 5.0, 0, 16)
    assert (args.verbose, args.interval, args.priority, args.max_workers) == expected


@pytest.mark.parametrize(
    ("values", "message"),
    [
        (["--set", "replicaCount=-1"], "at '/replicaCount': minimum: got -1, want 0"),
        (["--set", "replicaCount=2"], "at '/replicaCount': maximum: got 2, want 1"),
        (["--set", "replicas=1"], "additional properties 'replicas' not allowed"),
        (
            ["--set", "operator.metricPort=1"],
            "at '/operator': additional properties 'metricPort' not allowed",
        ),
        (["--set", "image.pullPolicy=Sometimes"], "at '/image/pullPolicy': value must be one of"),
        (["--set", "image.tag=latest"], 'image.tag "latest" is refused'),
        (["--set", "watchNamespaces={Team_A}"], "at '/watchNamespaces/0'"),
        (["--set", "operator.healthPort=70000"], "at '/operator/healthPort': maximum"),
        (["--set", "operator.healthPort=9401"], "give them different ports"),
        (["--set", "serviceAccount.create=false"], "serviceAccount.name is required"),
    ],
)
def test_wrong_values_are_refused_with_the_key_named(values: list[str], message: str) -> None:
    result = helm("template", "rel", str(CHART), *values)
    assert result.returncode != 0
    assert message in result.stderr, result.stderr


def test_lint_refuses_a_negative_replica_count() -> None:
    result = helm("lint", str(CHART), "--set", "replicaCount=-1")
    assert result.returncode != 0
    assert "at '/replicaCount': minimum" in result.stdout + result.stderr


def _leaf_paths(values: dict[str, Any], prefix: str = "") -> list[str]:
    paths = []
    for key, value in values.items():
        if isinstance(value, dict) and value:
            paths += _leaf_paths(value, f"{prefix}{key}.")
        else:
            paths.append(prefix + key)
    return paths


def _schema_at(schema: dict[str, Any], path: str) -> dict[str, Any] | None:
    node: dict[str, Any] | None = schema
    for part in path.split("."):
        if node is None or node.get("additionalProperties", True) is not False:
            return node  # a free-form Kubernetes object (resources, securityContext, ...)
        node = node.get("properties", {}).get(part)
    return node


def test_every_value_is_in_the_schema_and_documented() -> None:
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    schema = json.loads((CHART / "values.schema.json").read_text())
    assert schema["additionalProperties"] is False
    for path in _leaf_paths(values):
        assert _schema_at(schema, path) is not None, f"values.yaml key {path} is not in values.schema.json"
    for key in schema["properties"]:
        assert key in values or key == "global", f"schema key {key} has no default in values.yaml"
    # Documented value by value: every key holding a value has a comment right above it, or sits
    # inside a block whose key has one.
    lines = (CHART / "values.yaml").read_text().splitlines()
    open_blocks: list[tuple[int, bool]] = []  # (indent, documented) of the enclosing keys
    for number, line in enumerate(lines):
        match = re.match(r"^(\s*)([A-Za-z]\w*):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        open_blocks = [block for block in open_blocks if block[0] < indent]
        commented = number > 0 and lines[number - 1].strip().startswith("#")
        documented = commented or any(doc for _, doc in open_blocks)
        if rest:
            assert documented, f"values.yaml line {number + 1}: {key} has no comment"
        open_blocks.append((indent, documented))


def test_chart_crd_is_the_generated_crd() -> None:
    generated = REPO / "crds" / CRD_FILE
    in_chart = CHART / "crds" / CRD_FILE
    assert generated.is_file(), f"{generated} is missing: run `make crds`"
    assert in_chart.is_file(), f"{in_chart} is missing: run `make crds`"
    assert in_chart.read_bytes() == generated.read_bytes(), (
        f"{in_chart} differs from {generated}: run `make crds`"
    )


def test_chart_ships_kopf_peering_crds() -> None:
    crds = list(yaml.safe_load_all((CHART / "crds" / "kopf.dev_peerings.yaml").read_text()))
    names = {c["metadata"]["name"]: c["spec"]["scope"] for c in crds}
    assert names == {"clusterkopfpeerings.kopf.dev": "Cluster", "kopfpeerings.kopf.dev": "Namespaced"}


def test_app_version_is_the_project_version() -> None:
    chart = yaml.safe_load((CHART / "Chart.yaml").read_text())
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert chart["appVersion"] == project["version"]
    assert operator_container(render())["image"].endswith(f":{project['version']}")


def notes_job_manifest(app_version: str) -> dict[str, Any]:
    """The job NOTES.txt tells a new user to apply (the heredoc between <<'YAML' and YAML)."""
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    match = re.search(r"<<'YAML'[^\n]*\n(.*?)\n\s*YAML\n", notes, re.S)
    assert match, "NOTES.txt has no job manifest heredoc"
    text = match.group(1).replace("{{ .Chart.AppVersion }}", app_version)
    assert "{{" not in text, "the NOTES job manifest uses a template expression this test does not know"
    manifest: dict[str, Any] = yaml.safe_load(textwrap.dedent(text))
    return manifest


def test_notes_first_job_is_a_valid_job_with_valid_trainer_flags() -> None:
    from dtjob.api import validate_job
    from dtjob.trainer import config as trainer_config

    job = notes_job_manifest("0.1.0")
    assert validate_job(job) == []
    (container,) = job["spec"]["template"]["spec"]["containers"]
    # The same command as the trainer image's ENTRYPOINT, so the job also runs where images are
    # not pulled (the devcluster).
    assert container["command"] == ["python", "-m", "dtjob.trainer"]
    parsed = trainer_config.parse(container["args"], environ={})
    assert parsed.strategy == "ddp" and parsed.model == "gpt"
    notes = (CHART / "templates" / "NOTES.txt").read_text()
    assert "kubectl apply" in notes and "kubectl get dtj" in notes

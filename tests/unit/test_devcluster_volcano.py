"""Volcano in the devcluster, without a cluster: its identities, command lines, RBAC and build."""

from __future__ import annotations

import subprocess
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from dtjob.devcluster import volcano
from dtjob.devcluster.binaries import BUILD_SCRIPT, Binaries, read_versions
from dtjob.devcluster.layout import Layout


def test_each_component_has_its_own_user_and_kubeconfig(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    volcano.ensure_pki(layout)
    for component, user in volcano.USERS.items():
        cert = x509.load_pem_x509_certificate((layout.pki / f"{component}.crt").read_bytes())
        assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == user
        assert not cert.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME), "no group (system:masters)"
        assert f"client-certificate: {layout.pki / component}.crt" in layout.kubeconfig(component).read_text()


def test_command_lines_carry_the_state_directory_and_the_release_configuration(tmp_path: Path) -> None:
    layout = Layout(tmp_path)
    binaries = Binaries.pinned()
    scheduler = volcano.command("vc-scheduler", layout, binaries)
    controllers = volcano.command("vc-controller-manager", layout, binaries)
    for argv in (scheduler, controllers):
        # `down` and the pid checks find a component by the state directory in its command line
        assert any(str(tmp_path) in a for a in argv)
        assert "--leader-elect=false" in argv and "--enable-healthz=true" in argv
        assert all("0.0.0.0" not in a for a in argv)
    assert scheduler[0].endswith("/volcano-v1.15.1/vc-scheduler")
    assert f"--scheduler-conf={tmp_path}/volcano/volcano-scheduler-ci.conf" in scheduler
    assert "--controllers=queue-controller,pg-controller" in controllers
    env = volcano.environment(layout, {"PATH": "/bin"})
    assert env["DEBUG_SOCKET_DIR"].startswith(str(tmp_path))


def test_rbac_binds_each_user_to_no_more_than_it_calls() -> None:
    objects = volcano.rbac_objects()
    roles = {o["metadata"]["name"]: o for o in objects if o["kind"] == "ClusterRole"}
    bindings = [o for o in objects if o["kind"] == "ClusterRoleBinding"]
    assert sorted(roles) == ["dtjob:vc-controller-manager", "dtjob:vc-scheduler"]
    for binding in bindings:
        (subject,) = binding["subjects"]
        assert subject["kind"] == "User" and subject["name"] in volcano.USERS.values()
    rules = [rule for role in roles.values() for rule in role["rules"]]
    for rule in rules:
        assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
        assert not {"secrets", "configmaps", "customresourcedefinitions"} & set(rule["resources"])
    writes = {"create", "update", "patch", "delete"}
    core_writes = {
        r
        for rule in rules
        if rule["apiGroups"] == [""] and writes & set(rule["verbs"])
        for r in rule["resources"]
    }
    assert core_writes == {"events", "pods", "pods/binding", "pods/status"}
    assert not [rule for rule in rules if "pods" in rule["resources"] and "create" in rule["verbs"]]


def test_volcano_binaries_are_only_wanted_when_asked_for(tmp_path: Path) -> None:
    versions = read_versions()
    binaries = Binaries("1.37.2", "3.7.3", "3.22.0", tmp_path, versions["VOLCANO_VERSION"])
    plain = {p.name for p in binaries.missing()}
    assert "vc-scheduler" not in plain
    wanted = {p.name for p in binaries.missing(volcano=True)}
    assert {"vc-scheduler", "vc-controller-manager", "crd"} <= wanted


def test_build_script_refuses_an_unknown_flag_with_its_usage() -> None:
    result = subprocess.run(
        ["bash", str(BUILD_SCRIPT), "--volcan"], capture_output=True, text=True, check=False
    )
    assert result.returncode == 2 and "usage:" in result.stderr and "--volcano" in result.stderr


def test_scheduler_configuration_is_the_releases_without_enqueue(tmp_path: Path) -> None:
    release = tmp_path / "cache" / "bin" / "volcano-v1.15.1" / "config"
    release.mkdir(parents=True)
    (release / "volcano-scheduler-ci.conf").write_text(
        'actions: "enqueue, allocate, backfill, reclaim, preempt"\ntiers:\n- plugins:\n  - name: gang\n'
    )
    binaries = Binaries("1.37.2", "3.7.3", "3.22.0", tmp_path / "cache", "1.15.1")
    written = yaml.safe_load(volcano.write_scheduler_conf(Layout(tmp_path), binaries).read_text())
    assert written == {
        "actions": "allocate, backfill, reclaim, preempt",
        "tiers": [{"plugins": [{"name": "gang"}]}],
    }

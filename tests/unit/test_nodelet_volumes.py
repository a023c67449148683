"""The nodelet's volume planning: supported types, hostPath checks, mount plans, item selection."""

from __future__ import annotations

from pathlib import Path

import pytest

from dtjob.devcluster.nodelet.logs_server import tail_lines
from dtjob.devcluster.nodelet.status import ContainerRun, exit_code
from dtjob.devcluster.nodelet.volumes import (
    HostVolume,
    VolumeError,
    VolumeNotReady,
    check_supported,
    host_path,
    mount_plan,
    select_items,
)


def test_unsupported_volume_type_is_named_in_the_error() -> None:
    pod = {"spec": {"volumes": [{"name": "ok", "emptyDir": {}}, {"name": "data", "nfs": {"server": "x"}}]}}
    with pytest.raises(VolumeError, match="volume 'data' has type 'nfs'") as info:
        check_supported(pod)
    assert info.value.reason == "UnsupportedVolume"


def test_host_path_types(tmp_path: Path) -> None:
    made = host_path({"path": str(tmp_path / "a" / "b"), "type": "DirectoryOrCreate"}, "v")
    assert made.is_dir()
    assert host_path({"path": str(tmp_path / "f"), "type": "FileOrCreate"}, "v").is_file()
    with pytest.raises(VolumeError, match="is not a Directory"):
        host_path({"path": str(tmp_path / "missing"), "type": "Directory"}, "v")


def test_mount_plan_sub_paths_and_read_only(tmp_path: Path) -> None:
    volumes = {"data": HostVolume(tmp_path / "data"), "token": HostVolume(tmp_path / "tok", read_only=True)}
    container = {
        "volumeMounts": [
            {"name": "data", "mountPath": "/data"},
            {"name": "data", "mountPath": "/ckpt", "subPathExpr": "$(POD)", "readOnly": True},
            {"name": "token", "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount"},
        ]
    }
    plan = mount_plan(container, volumes, {"POD": "p0"})
    assert plan == [
        {"source": str(tmp_path / "data"), "target": "/data", "readOnly": False},
        {"source": str(tmp_path / "data" / "p0"), "target": "/ckpt", "readOnly": True},
        {
            "source": str(tmp_path / "tok"),
            "target": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True,
        },
    ]
    assert (tmp_path / "data" / "p0").is_dir()
    with pytest.raises(VolumeError, match="relative path"):
        mount_plan({"volumeMounts": [{"name": "data", "mountPath": "/x", "subPath": "../etc"}]}, volumes, {})
    with pytest.raises(VolumeError, match="names no volume"):
        mount_plan({"volumeMounts": [{"name": "nope", "mountPath": "/x"}]}, volumes, {})


def test_select_items() -> None:
    data = {"a": b"1", "b": b"2"}
    assert select_items(data, None, "cm", False) == data
    assert select_items(data, [{"key": "b", "path": "dir/b.txt"}], "cm", False) == {"dir/b.txt": b"2"}
    assert select_items(data, [{"key": "c", "path": "c"}], "cm", True) == {}
    with pytest.raises(VolumeNotReady):
        select_items(data, [{"key": "c", "path": "c"}], "cm", False)


def test_tail_lines_and_exit_codes() -> None:
    assert tail_lines(b"a\nb\nc\n", 2) == b"b\nc\n"
    assert tail_lines(b"a\nb\nc", 1) == b"c"
    assert tail_lines(b"a\n", 0) == b""
    assert exit_code(3) == 3 and exit_code(-15) == 143


def test_container_status_through_a_restart() -> None:
    run = ContainerRun("trainer", "img")
    run.running(pid=42)
    assert run.status()["state"]["running"] and run.status()["ready"]
    run.terminated(3)
    st = run.status()
    assert st["state"]["terminated"]["exitCode"] == 3 and st["state"]["terminated"]["reason"] == "Error"
    run.restarting()
    run.waiting("CrashLoopBackOff")
    st = run.status()
    assert st["restartCount"] == 1 and st["lastState"]["terminated"]["exitCode"] == 3
    assert st["state"] == {"waiting": {"reason": "CrashLoopBackOff"}}

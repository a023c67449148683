"""A pod's sandbox: its network namespace (a veth on the node bridge, a pod IP, a default route via
the bridge), the /etc/netns/<netns>/{hosts,resolv.conf} that `ip netns exec` mounts over /etc, and
the command line that starts a container inside it.
"""

from __future__ import annotations

import functools
import ipaddress
import logging
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from dtjob.devcluster.nodelet.state import NodeState, write_json

log = logging.getLogger(__name__)

ETC_NETNS = Path("/etc/netns")
CONTAINER_INIT = Path(__file__).with_name("container_init.py")
# What every container runs with and must still see after its volumes are mounted (an emptyDir at
# /tmp would hide a checkout under /tmp): the Python installation, the venv, and the checkout
# whose sources the editable install points at (this file is <checkout>/devcluster/dtjob/...).
KEEP_VISIBLE = sorted({sys.base_prefix, sys.prefix, str(Path(__file__).resolve().parents[4])})


class SandboxError(Exception):
    pass


@dataclass(frozen=True)
class Sandbox:
    netns: str
    veth: str
    ip: str


def netns_name(uid: str) -> str:
    return f"dtjob-{uid[:12]}"


def veth_name(uid: str) -> str:
    # Interface names are at most 15 characters.
    return "dtj" + uid.replace("-", "")[:12]


def _ip(*args: str, check: bool = True) -> None:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    if check and result.returncode != 0:
        raise SandboxError(f"`ip {' '.join(args)}` failed: {result.stderr.strip()}")


def allocate_ip(state: NodeState, pod_cidr: str) -> str:
    """The lowest address of the node's pod CIDR that no recorded sandbox holds (.1 is left out by
    convention for a gateway)."""
    used = {box.get("ip") for box in state.recorded_sandboxes()}
    net = ipaddress.ip_network(pod_cidr)
    for host in list(net.hosts())[1:]:
        if str(host) not in used:
            return str(host)
    raise SandboxError(f"pod CIDR {pod_cidr} is full ({len(used)} pods)")


def create(state: NodeState, uid: str, pod_cidr: str, bridge: str, gateway: str, prefix_len: int) -> Sandbox:
    """Creates the netns and veth and gives the pod its IP. The record is written first, so a crash
    half-way still leaves something for cleanup.kill_node to remove."""
    box = Sandbox(netns_name(uid), veth_name(uid), allocate_ip(state, pod_cidr))
    write_json(state.sandbox_file(uid), box.__dict__)
    teardown(box.netns, box.veth)  # leftovers of an earlier attempt with the same uid
    _ip("netns", "add", box.netns)
    _ip("link", "add", box.veth, "type", "veth", "peer", "name", "eth0", "netns", box.netns)
    _ip("link", "set", box.veth, "master", bridge)
    _ip("link", "set", box.veth, "up")
    _ip("-n", box.netns, "link", "set", "lo", "up")
    _ip("-n", box.netns, "addr", "add", f"{box.ip}/{prefix_len}", "dev", "eth0")
    _ip("-n", box.netns, "link", "set", "eth0", "up")
    _ip("-n", box.netns, "route", "add", "default", "via", gateway)
    return box


def teardown(netns: str, veth: str) -> None:
    """Deletes the netns, the host end of its veth and /etc/netns/<netns>; missing parts are fine."""
    _ip("netns", "del", netns, check=False)
    _ip("link", "del", veth, check=False)
    shutil.rmtree(ETC_NETNS / netns, ignore_errors=True)


def write_etc(netns: str, hosts: str, resolv_conf: str) -> None:
    d = ETC_NETNS / netns
    d.mkdir(parents=True, exist_ok=True)
    (d / "resolv.conf").write_text(resolv_conf)
    update_hosts(netns, hosts)


def update_hosts(netns: str, text: str) -> None:
    """Rewrites the hosts file in place: `ip netns exec` bind-mounted this very inode over
    /etc/hosts in running containers, so replacing the file by a rename would not reach them. The
    new text is written before the file is cut to length, so a reader never sees it empty."""
    path = ETC_NETNS / netns / "hosts"
    data = text.encode()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


def launch_argv(netns: str, plan: Path) -> list[str]:
    """The command that runs a container: in the pod's netns (which mounts its hosts and
    resolv.conf), in a private mount namespace (volumes are bind-mounted there and nowhere else)
    and its own UTS namespace (the pod's hostname), container_init.py applies `plan` and execs the
    container's command. container_init.py is a stdlib-only script run with -I -S: it starts fast and
    ignores the caller's PYTHON* variables."""
    # fmt: off
    return [
        "ip", "netns", "exec", netns,
        "unshare", "--mount", "--uts", "--propagation", "private",
        sys.executable, "-I", "-S", str(CONTAINER_INIT), str(plan),
    ]
    # fmt: on


@functools.cache
def can_run_python(uid: int, gids: tuple[int, ...]) -> bool:
    """Whether a process of this user and these groups can execute the checkout's Python: every
    directory on the way to the interpreter (through the venv's symlink) must be searchable. A
    Python installed under a root-only home (/root is 0700) is not, for any other user."""
    paths = [Path(sys.executable).absolute(), Path(sys.executable).resolve()]
    for path in paths:
        for p in [*reversed(path.parents), path]:
            st = os.stat(p)
            if st.st_uid == uid:
                bit = stat.S_IXUSR
            elif st.st_gid in gids:
                bit = stat.S_IXGRP
            else:
                bit = stat.S_IXOTH
            if not st.st_mode & bit:
                return False
    return True

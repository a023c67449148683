"""The pod network's host side: the bridge every pod veth attaches to, and IP forwarding.

Contract with the nodelet: bridge `dtjob0` holds 10.244.0.1/16; pods of node i get addresses in
10.244.i.0/24 with a default route via 10.244.0.1, where they also reach the API server.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.layout import BRIDGE, BRIDGE_ADDRESS, BRIDGE_PREFIX_LEN

IP_FORWARD = Path("/proc/sys/net/ipv4/ip_forward")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        result = subprocess.run(["ip", *args], capture_output=True, text=True, check=False)
    except FileNotFoundError:
        raise DevclusterError("the `ip` command (iproute2) is missing; install iproute2") from None
    if check and result.returncode != 0:
        raise DevclusterError(
            f"`ip {' '.join(args)}` failed: {result.stderr.strip()} (devcluster needs root)"
        )
    return result


def link_exists(name: str) -> bool:
    return _ip("link", "show", "dev", name, check=False).returncode == 0


def bridge_exists(name: str = BRIDGE) -> bool:
    return link_exists(name)


def set_link(name: str, up: bool) -> None:
    """An interface up or down (a pod's veth: `dtjob devcluster net up|down`)."""
    _ip("link", "set", "dev", name, "up" if up else "down")


def bridge_addresses(name: str = BRIDGE) -> list[str]:
    out = _ip("-j", "addr", "show", "dev", name).stdout
    return [f"{a['local']}/{a['prefixlen']}" for link in json.loads(out) for a in link.get("addr_info", [])]


def ensure_bridge(owner_file: Path, saved_ip_forward: Path) -> None:
    """Creates (or repairs) the bridge with its address, brings it up, and turns on IP forwarding
    (pods of different nodes sit in different /24s and route through the host); the previous
    ip_forward value is saved so `down` can restore it. `owner_file` records that this state
    directory's cluster uses the bridge: `down` of another state directory leaves it alone."""
    owner_file.write_text(f"{BRIDGE}\n")
    if not bridge_exists():
        _ip("link", "add", BRIDGE, "type", "bridge")
    wanted = f"{BRIDGE_ADDRESS}/{BRIDGE_PREFIX_LEN}"
    if wanted not in bridge_addresses():
        _ip("addr", "add", wanted, "dev", BRIDGE)
    _ip("link", "set", BRIDGE, "up")
    current = IP_FORWARD.read_text().strip()
    if current != "1":
        if not saved_ip_forward.exists():
            saved_ip_forward.write_text(current + "\n")
        IP_FORWARD.write_text("1\n")


def bridge_ports(name: str = BRIDGE) -> list[str]:
    """Interfaces (pod veths) still attached to the bridge."""
    result = _ip("-j", "link", "show", "master", name, check=False)
    if result.returncode != 0 or not result.stdout.strip():
        return []
    return [link["ifname"] for link in json.loads(result.stdout)]


def delete_bridge(owner_file: Path, saved_ip_forward: Path) -> None:
    """Deletes leftover veths on the bridge, the bridge, and restores ip_forward - only when this
    state directory's cluster owns the bridge (see ensure_bridge)."""
    if not owner_file.exists():
        return
    if bridge_exists():
        for port in bridge_ports():
            _ip("link", "del", port, check=False)
        _ip("link", "del", BRIDGE)
    if saved_ip_forward.exists():
        IP_FORWARD.write_text(saved_ip_forward.read_text())
        saved_ip_forward.unlink()
    owner_file.unlink()

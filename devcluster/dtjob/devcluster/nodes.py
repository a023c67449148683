"""Starting and stopping nodelets, dtjob's node agents (package dtjob.devcluster.nodelet)."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path

from dtjob.devcluster import processes
from dtjob.devcluster.binaries import DEVCLUSTER_SOURCE
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.layout import BRIDGE, BRIDGE_ADDRESS, KUBELET_BASE_PORT, Layout, node_index, pod_cidr

# This checkout, and its source roots (the namespace package dtjob spans them): prepended to the
# nodelet's PYTHONPATH so it and its pods import this checkout even without the editable install.
CHECKOUT = DEVCLUSTER_SOURCE.parent
SOURCE_ROOTS = [CHECKOUT / d for d in ("operator", "trainer_image", "devcluster")]


@dataclass(frozen=True)
class NodeShape:
    """Capacity every node advertises."""

    cpus: str
    memory: str
    gpus: int


def command(layout: Layout, name: str, shape: NodeShape) -> list[str]:
    i = node_index(name)
    d = layout.node_dir(name)
    return [
        sys.executable,
        "-m",
        "dtjob.devcluster.nodelet",
        f"--name={name}",
        f"--kubeconfig={d / 'kubeconfig'}",
        f"--state-dir={d}",
        f"--ca-cert={layout.ca_cert}",
        f"--serving-cert={d / 'serving.crt'}",
        f"--serving-key={d / 'serving.key'}",
        f"--kubelet-port={KUBELET_BASE_PORT + i}",
        f"--node-ip={BRIDGE_ADDRESS}",
        f"--pod-cidr={pod_cidr(i)}",
        f"--bridge={BRIDGE}",
        f"--cpus={shape.cpus}",
        f"--memory={shape.memory}",
        f"--gpus={shape.gpus}",
    ]


def environment() -> dict[str, str]:
    """The nodelet's environment: this Python's bin directory first on PATH (pods run commands with
    the checkout's Python environment) and the checkout's source roots on PYTHONPATH."""
    env = dict(os.environ)
    env.pop("KUBECONFIG", None)
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")])
    roots = [str(r) for r in SOURCE_ROOTS if r.is_dir()]
    if env.get("PYTHONPATH"):
        roots.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(roots)
    return env


def pid(layout: Layout, name: str) -> int | None:
    """The running nodelet's pid (its command line names its own state directory)."""
    return processes.read_pid(layout.node_pid_file(name), f"--state-dir={layout.node_dir(name)} ")


def start(layout: Layout, name: str, shape: NodeShape) -> int:
    running = pid(layout, name)
    if running is not None:
        return running
    layout.node_checkout_file(name).write_text(f"{CHECKOUT}\n")
    return processes.start(
        command(layout, name, shape), layout.log(name), layout.node_pid_file(name), environment()
    )


def checkout(layout: Layout, name: str) -> str:
    """The checkout a running node's pods run ("" when unknown: started before it was recorded)."""
    try:
        return layout.node_checkout_file(name).read_text().strip()
    except OSError:
        return ""


def check_same_checkout(layout: Layout, running: dict[str, str]) -> None:
    """Refuses a cluster whose nodelets run another checkout's code: every pod (the workers, the
    helm chart's operator) runs the Python and sources of the checkout that started its node, so a
    test or demo of this checkout on that cluster would silently run the other one's trainer and
    operator (issue #46). `running`: node name -> its checkout."""
    others = {node: path for node, path in running.items() if path != str(CHECKOUT)}
    if others:
        where = ", ".join(
            f"{node} runs {path or 'an unrecorded checkout'}" for node, path in sorted(others.items())
        )
        raise DevclusterError(
            f"the devcluster in {layout.root} runs another checkout's code ({where}), and its pods "
            f"would run that code, not this checkout's ({CHECKOUT}); `dtjob devcluster down` it "
            "first (or use that checkout)"
        )


def stop(layout: Layout, name: str) -> None:
    """Node loss: SIGKILL the nodelet (no goodbye to the API server), then kill its pods and remove
    their network namespaces, veths, /etc/netns entries and mounts."""
    running = pid(layout, name)
    if running is not None:
        processes.kill(running)
    layout.node_pid_file(name).unlink(missing_ok=True)
    try:
        from dtjob.devcluster.nodelet.cleanup import kill_node
    except ImportError as e:
        print(f"devcluster: warning: cannot clean up {name}'s pods ({e})", file=sys.stderr)
        return
    kill_node(layout.node_dir(name))

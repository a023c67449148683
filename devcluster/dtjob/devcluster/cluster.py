"""The devcluster as a whole: `up`, `down`, `status`, `env`, node loss (`node stop|start`) and one
pod's network cut (`net down|up`)."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import yaml

from dtjob.devcluster import controlplane, kwok, network, nodes, processes, prometheus, volcano
from dtjob.devcluster.apiclient import ApiClient
from dtjob.devcluster.binaries import Binaries
from dtjob.devcluster.errors import DevclusterError
from dtjob.devcluster.host import port_free
from dtjob.devcluster.layout import CONTROL_PLANE, KUBELET_BASE_PORT, Layout, node_name
from dtjob.devcluster.nodes import NodeShape

# How long `up` waits for each stage on this shared 2-core machine before giving up.
COMPONENT_TIMEOUT = 180.0
NODES_TIMEOUT = 180.0


@dataclass(frozen=True)
class ClusterConfig:
    """The `up` options; saved in cluster.json so later commands use the same shape."""

    nodes: int = 3
    gpus_per_node: int = 2
    cpus_per_node: str = "4"
    memory_per_node: str = "8Gi"
    # Simulated nodes (KWOK, dtjob.devcluster.kwok): how many, and what each one offers.
    fake_nodes: int = 0
    fake_gpus_per_node: int = 8
    fake_cpus_per_node: str = "64"
    fake_memory_per_node: str = "512Gi"
    fake_pods_per_node: int = 110
    volcano: bool = False
    # Prometheus on 127.0.0.1:9090 scraping the operator and the trainers (dtjob.devcluster.prometheus).
    prometheus: bool = False

    @property
    def node_names(self) -> list[str]:
        return [node_name(i) for i in range(1, self.nodes + 1)]

    @property
    def shape(self) -> NodeShape:
        return NodeShape(self.cpus_per_node, self.memory_per_node, self.gpus_per_node)


def load_config(layout: Layout) -> ClusterConfig | None:
    try:
        return ClusterConfig(**json.loads(layout.cluster_file.read_text()))
    except (OSError, ValueError, TypeError):
        return None


@contextlib.contextmanager
def locked(layout: Layout) -> Iterator[None]:
    """One `up`/`down`/`node` at a time per state directory (parallel test sessions share it)."""
    layout.root.mkdir(parents=True, exist_ok=True)
    with layout.lock_file.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def marker(layout: Layout) -> str:
    """Every process of this cluster has a path inside the state directory on its command line."""
    return f"{layout.root}/"


def components(config: ClusterConfig) -> tuple[str, ...]:
    """The cluster's processes other than nodelets, in start order."""
    return CONTROL_PLANE + (volcano.COMPONENTS if config.volcano else ())


def component_pid(layout: Layout, component: str) -> int | None:
    return processes.read_pid(layout.pid_file(component), marker(layout))


def is_up(layout: Layout) -> bool:
    """A cluster is up when its API server process is alive (health is `status`'s business)."""
    return component_pid(layout, "kube-apiserver") is not None


def check_ports(layout: Layout, config: ClusterConfig) -> None:
    """Before starting anything: every port a component that is not running yet needs is free."""
    wanted: list[tuple[int, str]] = []
    ports = {**controlplane.PORTS, **volcano.PORTS}
    for component in components(config):
        if component_pid(layout, component) is None:
            wanted += [(port, component) for port in ports[component]]
    for i, name in enumerate(config.node_names, start=1):
        if nodes.pid(layout, name) is None:
            wanted.append((KUBELET_BASE_PORT + i, f"nodelet {name}"))
    for port, owner in wanted:
        if not port_free(port):
            raise DevclusterError(
                f"port {port} (needed by {owner}) is in use by another process; stop it "
                f"(`ss -ltnp 'sport = :{port}'` shows which) or `dtjob devcluster down` a cluster "
                f"started from another state directory, then retry"
            )


def _wait(what: str, check: Callable[[], bool], timeout: float, pid: int | None, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        if pid is not None and not processes.is_running(pid):
            raise DevclusterError(
                f"{what} exited during start-up: {controlplane.last_log_line(log)} (log: {log})"
            )
        time.sleep(0.5)
    raise DevclusterError(f"{what} was not ready after {timeout:.0f}s; see {log}")


def up(layout: Layout, requested: dict[str, object], timeout: float = COMPONENT_TIMEOUT) -> int:
    """Starts whatever of the cluster is not running and waits until it is healthy."""
    binaries = Binaries.pinned()
    with locked(layout):
        saved = load_config(layout)
        running = is_up(layout)
        if running and saved is not None:
            # Simulated nodes are API objects: their number may change on a running cluster.
            # --volcano adds Volcano to a running cluster; without it, a running Volcano stays.
            # The same for --prometheus.
            add_volcano = bool(requested.get("volcano"))
            add_prometheus = bool(requested.get("prometheus"))
            config = replace(
                saved, volcano=saved.volcano or add_volcano, prometheus=saved.prometheus or add_prometheus
            )
            fake_nodes = requested.get("fake_nodes")
            if isinstance(fake_nodes, int):
                config = replace(config, fake_nodes=fake_nodes)
            shape = {k: v for k, v in requested.items() if k not in ("fake_nodes", "volcano", "prometheus")}
            changed = {k: v for k, v in shape.items() if v is not None and getattr(saved, k) != v}
            if changed:
                raise DevclusterError(
                    f"a cluster is already up in {layout.root} with {asdict(saved)}; "
                    f"run `dtjob devcluster down` first to change {', '.join(sorted(changed))}"
                )
            live = [name for name in saved.node_names if nodes.pid(layout, name) is not None]
            nodes.check_same_checkout(layout, {name: nodes.checkout(layout, name) for name in live})
        else:
            config = ClusterConfig(**{k: v for k, v in requested.items() if v is not None})  # type: ignore[arg-type]
        if config.nodes < 0 or config.gpus_per_node < 0:
            raise DevclusterError("--nodes and --gpus-per-node must be >= 0 (--nodes 0: control plane only)")
        if config.fake_nodes < 0 or config.fake_gpus_per_node < 0:
            raise DevclusterError("--fake-nodes and --fake-gpus-per-node must be >= 0")
        if config.fake_nodes:
            kwok.check_shape(config.nodes)
            kwok.check_buildable()
        if config.prometheus:
            prometheus.check_buildable()

        binaries.check_buildable(config.volcano)
        check_ports(layout, config)
        binaries.build_missing(layout.log("build"), volcano=config.volcano)
        if config.fake_nodes:
            kwok.build_missing(layout.log("build"))
        if config.prometheus:
            prometheus.build_missing(layout.log("build"))
        started: list[str] = []
        try:
            _start_missing(layout, binaries, config, running, started, timeout)
        except DevclusterError as e:
            if started:
                raise DevclusterError(f"{e}; `dtjob devcluster down` cleans up what started") from None
            raise

    if started:
        print(f"devcluster: up in {layout.root} (started {', '.join(started)})")
    else:
        print(f"devcluster: already up in {layout.root}; nothing changed")
    simulated = f" and {config.fake_nodes} simulated (KWOK)" if config.fake_nodes else ""
    print(f'devcluster: {config.nodes} nodes{simulated}, run: eval "$(dtjob devcluster env)"')
    return 0


def _start_missing(
    layout: Layout,
    binaries: Binaries,
    config: ClusterConfig,
    running: bool,
    started: list[str],
    timeout: float,
) -> None:
    """Starts each component and node that is not running (appending its name to `started`), in
    dependency order, waiting for each component to be healthy and then for every node to be Ready."""
    if not running:
        _reset_logs(layout)
    for d in (layout.logs, layout.pids, layout.nodes):
        d.mkdir(parents=True, exist_ok=True)
    controlplane.ensure_pki(layout)
    network.ensure_bridge(layout.bridge_owner, layout.saved_ip_forward)
    layout.cluster_file.write_text(json.dumps(asdict(config)) + "\n")
    for component in CONTROL_PLANE:
        pid = component_pid(layout, component)
        if pid is None:
            argv = controlplane.command(component, layout, binaries)
            pid = processes.start(argv, layout.log(component), layout.pid_file(component))
            started.append(component)
        healthy = functools.partial(controlplane.healthy, component, layout)
        _wait(component, healthy, timeout, pid, layout.log(component))
    _grant_nodelet_rbac(layout)
    since: dict[str, float | None] = {}
    for name in config.node_names:
        stopped = layout.node_stopped_file(name)
        if running and stopped.exists():
            # Node loss simulated by `node stop` is a state of the cluster, not something `up`
            # repairs: another test session's `up` must not revive a node mid node-loss test.
            print(f"devcluster: {name} stays stopped (`dtjob devcluster node start {name}` starts it)")
            continue
        stopped.unlink(missing_ok=True)
        controlplane.ensure_node_pki(layout, name)
        since[name] = None
        if nodes.pid(layout, name) is None:
            since[name] = time.time()
            nodes.start(layout, name, config.shape)
            started.append(name)
    _wait_nodes_ready(layout, since, NODES_TIMEOUT)
    _wait_default_service_account(layout, timeout)
    if config.fake_nodes or kwok.pid(layout) is not None:
        c = config
        kwok.ensure(
            layout,
            c.fake_nodes,
            c.fake_gpus_per_node,
            c.fake_cpus_per_node,
            c.fake_memory_per_node,
            c.fake_pods_per_node,
            started,
        )
    if config.volcano:
        _start_volcano(layout, binaries, started, timeout)
    if config.prometheus:
        prometheus.ensure(layout, started)


def _start_volcano(layout: Layout, binaries: Binaries, started: list[str], timeout: float) -> None:
    """Volcano's RBAC, CRDs and queues, then its controller manager and scheduler; returns once
    the queue controller has opened the default queue (until then the scheduler refuses every
    job in it)."""
    volcano.ensure_pki(layout)
    volcano.write_scheduler_conf(layout, binaries)
    volcano.install(layout, binaries, timeout)
    for component in volcano.COMPONENTS:
        pid = component_pid(layout, component)
        if pid is None:
            argv = volcano.command(component, layout, binaries)
            env = volcano.environment(layout, os.environ)
            pid = processes.start(argv, layout.log(component), layout.pid_file(component), env)
            started.append(component)
        _wait(component, functools.partial(volcano.healthy, component), timeout, pid, layout.log(component))
    _wait(
        "the default Volcano queue to be Open",
        lambda: volcano.queue_state(layout, "default") == "Open",
        timeout,
        component_pid(layout, "vc-controller-manager"),
        layout.log("vc-controller-manager"),
    )


def _grant_nodelet_rbac(layout: Layout) -> None:
    """Applies the RBAC the nodelet asks for beyond the Node authorizer (nodelet/rbac.py)."""
    from dtjob.devcluster.nodelet.rbac import NODE_DNS_RBAC_YAML

    client = ApiClient(layout)
    for obj in yaml.safe_load_all(NODE_DNS_RBAC_YAML):
        path = f"/apis/rbac.authorization.k8s.io/v1/{obj['kind'].lower()}s"
        status = client.create(path, obj)
        if status not in (200, 201, 409):
            raise DevclusterError(
                f"creating {obj['kind']} {obj['metadata']['name']} failed with HTTP {status}"
            )


def _reset_logs(layout: Layout) -> None:
    """A fresh cluster starts with fresh component logs (the build log is kept)."""
    if layout.logs.is_dir():
        for log in layout.logs.glob("*.log"):
            if log.name != "build.log":
                log.unlink()


def _wait_nodes_ready(layout: Layout, since: dict[str, float | None], timeout: float) -> None:
    """Waits until every node in `since` is Ready. A node with a start time (time.time()) counts
    only with a Ready heartbeat at or after it, so a restarted node is not taken for Ready on the
    strength of the status its previous nodelet posted."""
    client = ApiClient(layout)
    names = list(since)
    deadline = time.monotonic() + timeout
    ready: dict[str, bool] = {}
    while time.monotonic() < deadline:
        ready = {n: client.node_ready(since[n]).get(n, False) for n in names}
        if all(ready.values()):
            return
        for name in names:
            if nodes.pid(layout, name) is None:
                raise DevclusterError(
                    f"nodelet {name} exited during start-up: "
                    f"{controlplane.last_log_line(layout.log(name))} (log: {layout.log(name)})"
                )
        time.sleep(0.5)
    waiting = [n for n in names if not ready.get(n)]
    raise DevclusterError(
        f"nodes {', '.join(waiting)} not Ready after {timeout:.0f}s; see {layout.log(waiting[0])}"
    )


def _wait_default_service_account(layout: Layout, timeout: float) -> None:
    """Pods are rejected until the controller manager created the `default` ServiceAccount, so a
    test that creates a pod right after `up` would race it."""
    client = ApiClient(layout)
    _wait(
        "the default ServiceAccount",
        lambda: client.get("/api/v1/namespaces/default/serviceaccounts/default")[0] == 200,
        timeout,
        None,
        layout.log("kube-controller-manager"),
    )


def down(layout: Layout) -> int:
    """Stops nodes (as node loss does), then the control plane, deletes the bridge, and sweeps up
    anything left: processes, mounts under the state directory. etcd's data goes too."""
    with locked(layout):
        was_up = is_up(layout)
        prometheus.stop(layout)
        kwok.stop(layout)
        names = sorted(p.name for p in layout.nodes.iterdir()) if layout.nodes.is_dir() else []
        for name in names:
            try:
                nodes.stop(layout, name)
            except Exception as e:  # a broken node cleanup must not keep the rest running
                print(f"devcluster: warning: cleaning up {name} failed: {e!r}; continuing", file=sys.stderr)
        for component in reversed(CONTROL_PLANE + volcano.COMPONENTS):
            pid = component_pid(layout, component)
            if pid is not None:
                processes.stop(pid)
            layout.pid_file(component).unlink(missing_ok=True)
        network.delete_bridge(layout.bridge_owner, layout.saved_ip_forward)
        leftovers = list(processes.find_by_marker(marker(layout)))
        for pid in leftovers:
            processes.kill(pid)
        _unmount_under(layout.root)
        for path in (layout.etcd_data, layout.nodes, layout.pids, layout.volcano_dir):
            if path.exists():
                shutil.rmtree(path)
        layout.cluster_file.unlink(missing_ok=True)
    print(f"devcluster: {'down' if was_up else 'nothing was running'} in {layout.root}")
    return 0


def _mounts_under(root: Path) -> list[str]:
    prefix = f"{root}/"
    points = [line.split()[4] for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    return [p for p in points if p.startswith(prefix)]


def _unmount_under(root: Path) -> None:
    """Lazily unmounts what a killed pod left mounted inside the state directory (deepest first), so
    deleting the directory can never reach through a bind mount into a hostPath."""
    for point in sorted(_mounts_under(root), key=len, reverse=True):
        subprocess.run(["umount", "-l", point], check=False, capture_output=True)
    left = _mounts_under(root)
    if left:
        raise DevclusterError(f"could not unmount {left[0]}; unmount it by hand, then run `down` again")


def env(layout: Layout) -> int:
    if not is_up(layout):
        raise DevclusterError(f"no cluster is running in {layout.root}; start one with `dtjob devcluster up`")
    b = Binaries.pinned()
    print(f"export KUBECONFIG={shlex.quote(str(layout.admin_kubeconfig))}")
    print(f'export PATH={shlex.quote(str(b.k8s_dir))}:{shlex.quote(str(b.helm_dir))}:"$PATH"')
    return 0


def status(layout: Layout) -> int:
    """Prints components and nodes; exit status 0 only when everything is healthy."""
    config = load_config(layout)
    if not is_up(layout) or config is None:
        print(f"devcluster: no cluster is running in {layout.root}")
        return 1
    binaries = Binaries.pinned()
    versions = f"kubernetes v{binaries.kubernetes_version}"
    if config.volcano:
        versions += f", volcano v{binaries.volcano_version}"
    print(f"devcluster: {layout.root} ({versions})")
    print(f"{'COMPONENT':<26}{'PID':>8}  {'ALIVE':<6} HEALTHY")
    ok = True
    for component in components(config):
        pid = component_pid(layout, component)
        if component in volcano.COMPONENTS:
            good = pid is not None and volcano.healthy(component)
        else:
            good = pid is not None and controlplane.healthy(component, layout)
        ok &= good
        print(f"{component:<26}{pid or '-':>8}  {_yes(pid is not None):<6} {_yes(good)}")
    ready = ApiClient(layout).node_ready()
    print(f"{'NODE':<26}{'PID':>8}  {'ALIVE':<6} READY")
    for name in config.node_names:
        pid = nodes.pid(layout, name)
        good = pid is not None and ready.get(name, False)
        if layout.node_stopped_file(name).exists():
            name += " (stopped)"
        ok &= good
        print(f"{name:<26}{pid or '-':>8}  {_yes(pid is not None):<6} {_yes(ready.get(name, False))}")
    if config.fake_nodes:
        good, lines = kwok.status_lines(layout, config.fake_nodes)
        ok &= good
        print("\n".join(lines))
    if config.prometheus:
        good, line = prometheus.status_line(layout)
        ok &= good
        print(line)
    return 0 if ok else 1


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _known_node(layout: Layout, name: str) -> ClusterConfig:
    config = load_config(layout)
    if not is_up(layout) or config is None:
        raise DevclusterError(f"no cluster is running in {layout.root}; start one with `dtjob devcluster up`")
    if name not in config.node_names:
        raise DevclusterError(f"no node {name!r}; this cluster has {', '.join(config.node_names)}")
    return config


def restart(layout: Layout, component: str, down_seconds: float = 0.0) -> int:
    """Control-plane failure: SIGKILL one component (etcd, the API server, ...), leave it down
    `down_seconds`, start it again with the same command and data, wait until it is healthy."""
    with locked(layout):
        if not is_up(layout) or load_config(layout) is None:
            raise DevclusterError(
                f"no cluster is running in {layout.root}; start one with `dtjob devcluster up`"
            )
        if component not in CONTROL_PLANE:
            known = ", ".join(CONTROL_PLANE)
            raise DevclusterError(f"no component {component!r}; the control plane is {known}")
        pid = component_pid(layout, component)
        if pid is not None:
            processes.kill(pid)
        layout.pid_file(component).unlink(missing_ok=True)
        time.sleep(down_seconds)
        argv = controlplane.command(component, layout, Binaries.pinned())
        pid = processes.start(argv, layout.log(component), layout.pid_file(component))
        healthy = functools.partial(controlplane.healthy, component, layout)
        _wait(component, healthy, COMPONENT_TIMEOUT, pid, layout.log(component))
    print(f"devcluster: restarted {component} after {down_seconds:g}s down")
    return 0


def node_stop(layout: Layout, name: str) -> int:
    with locked(layout):
        _known_node(layout, name)
        nodes.stop(layout, name)
        layout.node_stopped_file(name).touch()
    print(f"devcluster: stopped {name} (its lease is no longer renewed; pods killed)")
    return 0


def node_start(layout: Layout, name: str, timeout: float = NODES_TIMEOUT) -> int:
    with locked(layout):
        config = _known_node(layout, name)
        layout.node_stopped_file(name).unlink(missing_ok=True)
        if nodes.pid(layout, name) is not None:
            print(f"devcluster: {name} is already running")
            return 0
        controlplane.ensure_node_pki(layout, name)
        network.ensure_bridge(layout.bridge_owner, layout.saved_ip_forward)
        since = time.time()
        nodes.start(layout, name, config.shape)
        _wait_nodes_ready(layout, {name: since}, timeout)
    print(f"devcluster: started {name}; it is Ready")
    return 0


def _pod_sandbox(layout: Layout, namespace: str, pod: str) -> tuple[str, str]:
    """(node, host end of the veth) of a running pod of this cluster: the pod's uid from the API
    server, its sandbox record from the nodelet's state (nodelet/state.py)."""
    status, body = ApiClient(layout).get(f"/api/v1/namespaces/{namespace}/pods/{pod}")
    if status == 404:
        raise DevclusterError(f"no pod {namespace}/{pod}")
    if status != 200:
        raise DevclusterError(f"reading pod {namespace}/{pod} failed (HTTP {status}): {body.strip()[:200]}")
    uid = json.loads(body)["metadata"]["uid"]
    records = sorted(layout.nodes.glob(f"*/pods/{uid}/sandbox.json")) if layout.nodes.is_dir() else []
    for record in records:
        try:
            veth = json.loads(record.read_text())["veth"]
        except (OSError, ValueError, KeyError):
            continue
        if network.link_exists(veth):
            return record.parents[2].name, str(veth)
    raise DevclusterError(
        f"pod {namespace}/{pod} has no network on this cluster's nodes "
        "(not started yet, finished, or its node is stopped)"
    )


def pod_network(layout: Layout, namespace: str, pod: str, up: bool) -> int:
    """Cuts one pod off the network (`net down`: the host end of its veth down, so nothing reaches
    it and it reaches nothing, the API server included; its processes keep running) or connects it
    again (`net up`)."""
    with locked(layout):
        if not is_up(layout):
            raise DevclusterError(
                f"no cluster is running in {layout.root}; start one with `dtjob devcluster up`"
            )
        node, veth = _pod_sandbox(layout, namespace, pod)
        network.set_link(veth, up)
    state = "connected again" if up else "cut off the network"
    print(f"devcluster: pod {namespace}/{pod} on {node} {state} (veth {veth} {'up' if up else 'down'})")
    return 0

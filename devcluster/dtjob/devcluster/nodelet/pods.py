"""One pod's life on this node: volumes, sandbox, init containers, containers, restarts, status,
and termination (SIGTERM, the grace period, SIGKILL)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dtjob.devcluster.nodelet import sandbox
from dtjob.devcluster.nodelet.config import NodeletConfig
from dtjob.devcluster.nodelet.dns import RESOLV_CONF, DnsRecord, render_hosts
from dtjob.devcluster.nodelet.env import SYSTEM_PATH, EnvError, command_line, container_env, referenced_names
from dtjob.devcluster.nodelet.kubeapi import ApiError, KubeApi
from dtjob.devcluster.nodelet.state import NodeState, write_json
from dtjob.devcluster.nodelet.status import Conditions, ContainerRun, exit_code, now
from dtjob.devcluster.nodelet.volumes import (
    HostVolume,
    VolumeBuilder,
    VolumeError,
    VolumeNotReady,
    mount_plan,
)

log = logging.getLogger(__name__)
Obj = dict[str, Any]

# Restart back-off: the kubelet's doubling from 10 s up to 5 min is cut to 1 s .. 30 s, because on
# a development cluster a crash loop should be visible quickly, not minutes later.
BACKOFF_START_S = 1.0
BACKOFF_MAX_S = 30.0
# How often a pod waiting for a volume source (an unbound claim, a ConfigMap) looks again.
VOLUME_RETRY_S = 2.0
DEFAULT_GRACE_S = 30


class PodFailure(Exception):
    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


def security(pod: Obj, container: Obj) -> Obj:
    """runAsUser/runAsGroup/supplementalGroups: the container's securityContext over the pod's."""
    merged = dict(pod["spec"].get("securityContext") or {})
    merged.update({k: v for k, v in (container.get("securityContext") or {}).items() if v is not None})
    groups = list(merged.get("supplementalGroups") or [])
    if merged.get("fsGroup") is not None:  # the kubelet adds the fsGroup to every container
        groups.append(merged["fsGroup"])
    return {
        "runAsUser": merged.get("runAsUser"),
        "runAsGroup": merged.get("runAsGroup"),
        "supplementalGroups": groups,
    }


# The kubelet's terminationMessagePolicy FallbackToLogsOnError: a container that failed without
# writing a termination message gets its log's last 80 lines, at most 2 KiB, as the message
# (MaxContainerTerminationMessageLogLines and ...LogLength in the kubelet).
FALLBACK_LOG_LINES = 80
FALLBACK_LOG_BYTES = 2048


def fallback_message(spec: Obj, log_file: Path) -> str:
    """The terminated state's message of a failed container: its log tail under
    FallbackToLogsOnError, nothing otherwise (the nodelet writes no termination message file)."""
    if spec.get("terminationMessagePolicy") != "FallbackToLogsOnError":
        return ""
    try:
        with open(log_file, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - FALLBACK_LOG_BYTES))
            tail = f.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(tail.splitlines()[-FALLBACK_LOG_LINES:])


async def patch_status(api: KubeApi, pod: Obj, status: Obj) -> None:
    """Patches a pod's status. The patch carries the pod's UID, as the kubelet's does, so a late
    report never lands on a new pod of the same name (the operator reuses worker names)."""
    meta = pod["metadata"]
    path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}/status"
    body = {"metadata": {"uid": meta["uid"]}, "status": status}
    try:
        await api.request("PATCH", path, body=body, patch="strategic")
    except ApiError as e:
        if e.status not in (404, 409, 422):  # gone, or replaced by a pod of the same name
            log.warning("status of pod %s/%s: %s", meta["namespace"], meta["name"], e)


@dataclass
class NodeContext:
    """What a pod worker needs of its node (PodManager keeps it current): the API client, the
    nodelet's configuration and state, where pods reach the API server, and the cluster's DNS
    records, which the manager replaces as Services and pods change."""

    api: KubeApi
    cfg: NodeletConfig
    state: NodeState
    api_address: tuple[str, str]
    dns_records: list[DnsRecord] = field(default_factory=list)


class PodWorker:
    def __init__(self, node: NodeContext, pod: Obj) -> None:
        self.node = node
        self.pod = pod
        meta, spec = pod["metadata"], pod["spec"]
        self.uid, self.ns, self.name = meta["uid"], meta["namespace"], meta["name"]
        self.hostname = spec.get("hostname") or self.name
        self.policy = spec.get("restartPolicy", "Always")
        self.init_specs: list[Obj] = spec.get("initContainers") or []
        self.specs: list[Obj] = spec.get("containers") or []
        self.init_runs = [ContainerRun(c["name"], c.get("image", ""), init=True) for c in self.init_specs]
        self.runs = [ContainerRun(c["name"], c.get("image", "")) for c in self.specs]
        self.procs: dict[str, asyncio.subprocess.Process] = {}
        self.phase = "Pending"
        self.reason = ""
        self.message = ""
        self.conditions = Conditions()
        self.box: sandbox.Sandbox | None = None
        self.sandbox_removed = False
        self.volumes: dict[str, HostVolume] = {}
        self.configmaps: dict[str, dict[str, str]] = {}
        self.secrets: dict[str, dict[str, str]] = {}
        self.start_time = now()
        self.terminating = asyncio.Event()
        self.node_shutdown = False  # set when the nodelet itself stops
        self.done = asyncio.Event()
        self._report_lock = asyncio.Lock()

    # ---- life cycle -------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
            if self.node_shutdown:
                self._fail("Terminated", "Pod was terminated in response to the node's shutdown")
        except PodFailure as e:
            self._fail(e.reason, e.message)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("pod %s/%s", self.ns, self.name)
            self._fail("NodeletError", f"the nodelet could not run the pod: {e}")
        finally:
            self.terminating.set()  # no container of a finished or failed pod starts again
            self._signal_all(signal.SIGKILL)
            if self.box is not None:
                self.sandbox_removed = True
                sandbox.teardown(self.box.netns, self.box.veth)
                # The pod IP is free again (a finished pod keeps it in its status, as with the
                # kubelet, but no endpoint lists a finished pod).
                self.node.state.sandbox_file(self.uid).unlink(missing_ok=True)
            with contextlib.suppress(Exception):
                await self.report()
            self.done.set()

    async def _run(self) -> None:
        self.conditions.set("PodReadyToStartContainers", False)
        self.conditions.set(
            "Initialized", not self.init_specs, "" if not self.init_specs else "ContainersNotInitialized"
        )
        self._update_ready()
        await self.report()
        if not await self._prepare():
            return
        for spec, run in zip(self.init_specs, self.init_runs, strict=True):
            if not await self._keep_running(spec, run):
                if not self.terminating.is_set():
                    self._fail(
                        "InitContainerFailed", f"init container {run.name!r} exited with code {run.exit_code}"
                    )
                return
        self.conditions.set("Initialized", True)
        self.phase = "Running"
        await asyncio.gather(*(self._keep_running(s, r) for s, r in zip(self.specs, self.runs, strict=True)))
        self.phase = "Succeeded" if all(r.exit_code == 0 for r in self.runs) else "Failed"
        self._update_ready()
        log.info("pod %s/%s %s", self.ns, self.name, self.phase)

    async def _prepare(self) -> bool:
        """Volumes, env sources and the sandbox; False if the pod was deleted meanwhile."""
        builder = VolumeBuilder(self.node.api, self.node.state, self.pod, self.node.cfg.ca_cert)
        while not self.terminating.is_set():
            try:
                self.volumes = await builder.build()
                break
            except VolumeError as e:
                raise PodFailure(e.reason, e.message) from None
            except VolumeNotReady as e:
                for run in self.init_runs + self.runs:
                    run.waiting("ContainerCreating", f"waiting for volumes: {e}")
                await self.report()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.terminating.wait(), VOLUME_RETRY_S)
        if self.terminating.is_set():
            return False
        await self._fetch_env_sources()
        cfg = self.node.cfg
        self.box = sandbox.create(
            self.node.state, self.uid, cfg.pod_cidr, cfg.bridge, cfg.node_ip, cfg.bridge_prefix_len
        )
        self.pod.setdefault("status", {}).update(
            {"podIP": self.box.ip, "podIPs": [{"ip": self.box.ip}], "hostIP": cfg.node_ip}
        )
        sandbox.write_etc(self.box.netns, self.hosts_text(self.node.dns_records), RESOLV_CONF)
        self.conditions.set("PodReadyToStartContainers", True)
        await self.report()
        return True

    async def _fetch_env_sources(self) -> None:
        cms, secrets = referenced_names(self.pod)
        for name in cms:
            with contextlib.suppress(ApiError):
                cm = await self.node.api.get(f"/api/v1/namespaces/{self.ns}/configmaps/{name}")
                self.configmaps[name] = dict(cm.get("data") or {})
        for name in secrets:
            with contextlib.suppress(ApiError):
                s = await self.node.api.get(f"/api/v1/namespaces/{self.ns}/secrets/{name}")
                self.secrets[name] = {
                    k: base64.b64decode(v).decode() for k, v in (s.get("data") or {}).items()
                }

    async def _keep_running(self, spec: Obj, run: ContainerRun) -> bool:
        """Runs one container, restarting it as restartPolicy says; True if it ended with exit 0."""
        backoff = BACKOFF_START_S
        while True:
            code = await self._run_once(spec, run)
            if self.terminating.is_set():
                return code == 0
            if run.init:
                restart = code != 0 and self.policy != "Never"
            else:
                restart = self.policy == "Always" or (self.policy == "OnFailure" and code != 0)
            if not restart:
                return code == 0
            run.restarting()
            run.waiting("CrashLoopBackOff", f"back-off {backoff:g}s restarting container {run.name!r}")
            self._update_ready()
            await self.report()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.terminating.wait(), backoff)
            if self.terminating.is_set():
                return False
            backoff = min(backoff * 2, BACKOFF_MAX_S)

    async def _run_once(self, spec: Obj, run: ContainerRun) -> int:
        if self.terminating.is_set() or self.box is None:
            return 1
        st = self.node.state
        try:
            env = container_env(self.pod, spec, self.configmaps, self.secrets, self.node.api_address)
            user = self._user(spec)
            if user["runAsUser"] not in (None, 0) and not any(
                e.get("name") == "HOME" for e in spec.get("env") or []
            ):
                env["HOME"] = "/"  # what a runtime sets for a uid without a passwd entry
            argv = command_line(spec, env)
            plan = {
                "hostname": self.hostname,
                "mounts": mount_plan(spec, self.volumes, env),
                "keep": sandbox.KEEP_VISIBLE,
                "env": env,
                "workingDir": spec.get("workingDir"),
                "argv": argv,
                **user,
            }
        except (EnvError, VolumeError) as e:
            raise PodFailure("CreateContainerConfigError", f"container {run.name!r}: {e}") from None
        plan_file = st.plan_file(self.uid, run.name)
        write_json(plan_file, plan)
        plan_file.chmod(0o600)  # it holds the container's env, secrets included
        log_file = st.log_file(self.uid, run.name, run.restart_count)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *sandbox.launch_argv(self.box.netns, plan_file),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={"PATH": SYSTEM_PATH},
            )
        st.record_process(self.uid, run.name, proc.pid)
        self.procs[run.name] = proc
        run.running(proc.pid)
        if self.terminating.is_set():  # deleted while it was starting
            self._signal(proc, signal.SIGTERM)
        self._update_ready()
        await self.report()
        returncode = await proc.wait()
        self.procs.pop(run.name, None)
        st.proc_file(self.uid, run.name).unlink(missing_ok=True)
        code = exit_code(returncode)
        run.terminated(code, fallback_message(spec, log_file) if code != 0 else "")
        log.info("pod %s/%s container %s exited with %d", self.ns, self.name, run.name, run.exit_code)
        self._update_ready()
        await self.report()
        return run.exit_code or 0

    def _user(self, spec: Obj) -> Obj:
        """The container's user, or root when that user could not run the checkout's Python."""
        user = security(self.pod, spec)
        uid = user["runAsUser"]
        if uid in (None, 0):
            return user
        gid = user["runAsGroup"] if user["runAsGroup"] is not None else uid
        if sandbox.can_run_python(int(uid), tuple(int(g) for g in [gid, *user["supplementalGroups"]])):
            return user
        log.warning(
            "pod %s/%s: uid %s cannot execute %s (a directory on the way is not searchable); runs as root",
            self.ns,
            self.name,
            uid,
            sys.executable,
        )
        return {"runAsUser": None, "runAsGroup": None, "supplementalGroups": []}

    async def terminate(self, grace: float) -> None:
        """SIGTERM to every container, SIGKILL to what is left after `grace` seconds; returns when
        the pod's processes are gone and its sandbox is removed."""
        self.terminating.set()
        self._signal_all(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._procs_exited(), grace)
        self._signal_all(signal.SIGKILL)
        await self.done.wait()

    async def _procs_exited(self) -> None:
        while self.procs:
            await asyncio.gather(*(p.wait() for p in list(self.procs.values())))
            await asyncio.sleep(0)

    def _signal_all(self, sig: int) -> None:
        for proc in list(self.procs.values()):
            self._signal(proc, sig)

    @staticmethod
    def _signal(proc: asyncio.subprocess.Process, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, sig)

    # ---- status -----------------------------------------------------------------------------

    def _fail(self, reason: str, message: str) -> None:
        log.warning("pod %s/%s failed: %s: %s", self.ns, self.name, reason, message)
        self.phase, self.reason, self.message = "Failed", reason, message
        for run in self.init_runs + self.runs:
            if run.state == "waiting":
                run.waiting(reason, message)
        self._update_ready()

    def _update_ready(self) -> None:
        ready = self.phase == "Running" and bool(self.runs) and all(r.state == "running" for r in self.runs)
        done = self.phase in ("Succeeded", "Failed")
        reason = "" if ready else ("PodCompleted" if done else "ContainersNotReady")
        self.conditions.set("ContainersReady", ready, reason)
        self.conditions.set("Ready", ready, reason)

    def status(self) -> Obj:
        st: Obj = {
            "phase": self.phase,
            "hostIP": self.node.cfg.node_ip,
            "hostIPs": [{"ip": self.node.cfg.node_ip}],
            "startTime": self.start_time,
            "conditions": self.conditions.as_list(),
            "containerStatuses": [r.status() for r in self.runs],
        }
        if self.init_runs:
            st["initContainerStatuses"] = [r.status() for r in self.init_runs]
        if self.box is not None:
            st["podIP"], st["podIPs"] = self.box.ip, [{"ip": self.box.ip}]
        if self.reason:
            st["reason"], st["message"] = self.reason, self.message
        return st

    async def report(self) -> None:
        """Sends the current status (a strategic merge patch: conditions of others are kept)."""
        async with self._report_lock:
            await patch_status(self.node.api, self.pod, self.status())

    # ---- DNS and logs -----------------------------------------------------------------------

    def hosts_text(self, records: list[DnsRecord]) -> str:
        assert self.box is not None
        return render_hosts(self.ns, self.box.ip, self.hostname, self.pod["spec"].get("subdomain"), records)

    def update_hosts(self, records: list[DnsRecord]) -> None:
        if self.box is not None and not self.sandbox_removed:
            sandbox.update_hosts(self.box.netns, self.hosts_text(records))

    def container_names(self) -> list[str]:
        return [r.name for r in self.init_runs + self.runs]

    def _find(self, container: str) -> ContainerRun | None:
        return next((r for r in self.init_runs + self.runs if r.name == container), None)

    def log_target(self, container: str, previous: bool) -> tuple[Path, int] | None:
        """(log file, run number) of the container's current run, or of the one before."""
        run = self._find(container)
        if run is None:
            return None
        attempt = run.restart_count - 1 if previous else run.restart_count
        return (self.node.state.log_file(self.uid, container, attempt), attempt) if attempt >= 0 else None

    def still_writing(self, container: str, attempt: int) -> bool:
        """Whether run `attempt` of the container may still add to its log (for `logs -f`)."""
        run = self._find(container)
        return (
            run is not None
            and not self.done.is_set()
            and run.restart_count == attempt
            and run.state != "terminated"
        )

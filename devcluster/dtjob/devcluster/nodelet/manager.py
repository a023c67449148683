"""The pods bound to this node: watches them, starts a PodWorker per pod, carries out deletions,
keeps every pod's /etc/hosts current, and fails pods whose processes a restart lost."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import Coroutine
from typing import Any
from urllib.parse import urlsplit

from dtjob.devcluster.nodelet.config import NodeletConfig
from dtjob.devcluster.nodelet.dns import DnsRecord
from dtjob.devcluster.nodelet.kubeapi import ApiError, KubeApi, Obj, list_and_watch
from dtjob.devcluster.nodelet.pods import DEFAULT_GRACE_S, NodeContext, PodWorker, patch_status
from dtjob.devcluster.nodelet.state import NodeState
from dtjob.devcluster.nodelet.status import now

log = logging.getLogger(__name__)

TERMINAL = ("Succeeded", "Failed")
# On SIGTERM the nodelet gives its pods this long to stop, and its whole shutdown this long, so
# `dtjob devcluster down` and `node stop` stay quick even when the API server is gone already.
SHUTDOWN_GRACE_S = 3.0
SHUTDOWN_TIMEOUT_S = 10.0


def was_started(pod: Obj) -> bool:
    """Whether a nodelet already ran this pod (it has a pod IP or a started container)."""
    st = pod.get("status") or {}
    if st.get("phase") == "Running" or st.get("podIP"):
        return True
    statuses = (st.get("containerStatuses") or []) + (st.get("initContainerStatuses") or [])
    return any(
        "running" in (s.get("state") or {}) or "terminated" in (s.get("state") or {}) for s in statuses
    )


def lost_status(pod: Obj) -> Obj:
    """Status of a pod whose processes died with an earlier run of this node's nodelet."""
    message = "the node's nodelet was restarted and the pod's processes are gone"
    lost = {"exitCode": 137, "reason": "ContainerStatusUnknown", "message": message, "finishedAt": now()}
    statuses = []
    for s in (pod.get("status") or {}).get("containerStatuses") or []:
        state = s.get("state") or {}
        statuses.append(
            {
                **s,
                "ready": False,
                "started": False,
                "state": state if "terminated" in state else {"terminated": lost},
            }
        )
    conditions = [
        {"type": t, "status": "False", "reason": "NodeLost", "lastTransitionTime": now()}
        for t in ("ContainersReady", "Ready")
    ]
    out: Obj = {"phase": "Failed", "reason": "NodeLost", "message": message, "conditions": conditions}
    if statuses:
        out["containerStatuses"] = statuses
    return out


class PodManager:
    def __init__(self, api: KubeApi, cfg: NodeletConfig, state: NodeState) -> None:
        self.api = api
        self.cfg = cfg
        self.state = state
        self.workers: dict[str, PodWorker] = {}
        # Pods reach the API server at the node IP (the bridge address) on the API server's port.
        self.node = NodeContext(api, cfg, state, (cfg.node_ip, str(urlsplit(api.server).port or 443)))
        self._listed_once = False
        self._tasks: set[asyncio.Task[Any]] = set()
        self._deleting: set[str] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def run(self, stop: asyncio.Event) -> None:
        params = {"fieldSelector": f"spec.nodeName={self.cfg.name}"}
        await list_and_watch(self.api, "/api/v1/pods", params, self._on_list, self._on_event, stop)

    def find(self, namespace: str, name: str) -> PodWorker | None:
        """The worker of the newest pod of that name (for the kubelet API's logs)."""
        found = [w for w in self.workers.values() if w.ns == namespace and w.name == name]
        return max(found, key=lambda w: w.start_time) if found else None

    async def on_dns(self, records: list[DnsRecord]) -> None:
        self.node.dns_records = records
        for worker in list(self.workers.values()):
            try:
                worker.update_hosts(records)
            except OSError as e:
                log.warning("hosts file of pod %s/%s: %s", worker.ns, worker.name, e)

    async def _on_list(self, pods: list[Obj]) -> None:
        first, self._listed_once = not self._listed_once, True
        present = {p["metadata"]["uid"] for p in pods}
        for pod in pods:
            await self._sync(pod, after_restart=first)
        for uid, worker in list(self.workers.items()):
            if uid not in present:  # deleted while the watch was down
                self.spawn(self._forget(worker))

    async def _on_event(self, kind: str, pod: Obj) -> None:
        if kind == "DELETED":
            worker = self.workers.get(pod["metadata"]["uid"])
            if worker is not None:
                self.spawn(self._forget(worker))
            return
        await self._sync(pod, after_restart=False)

    async def _sync(self, pod: Obj, after_restart: bool) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        worker = self.workers.get(uid)
        if meta.get("deletionTimestamp"):
            if uid not in self._deleting:
                self._deleting.add(uid)
                self.spawn(self._delete(pod, worker))
            return
        if worker is not None:
            worker.pod["metadata"] = meta  # labels/annotations for later fieldRefs
            return
        phase = (pod.get("status") or {}).get("phase")
        if phase in TERMINAL:
            return
        if after_restart and was_started(pod):
            log.warning(
                "pod %s/%s: its processes died with the previous nodelet; marking it Failed",
                meta["namespace"],
                meta["name"],
            )
            self.spawn(patch_status(self.api, pod, lost_status(pod)))
            return
        worker = PodWorker(self.node, pod)
        self.workers[uid] = worker
        log.info("starting pod %s/%s", meta["namespace"], meta["name"])
        self.spawn(worker.run())

    async def _delete(self, pod: Obj, worker: PodWorker | None) -> None:
        """Graceful deletion: stop the containers within the grace period, remove the sandbox, then
        remove the pod object (grace 0, only if it is still this pod)."""
        meta = pod["metadata"]
        grace = meta.get("deletionGracePeriodSeconds")
        if grace is None:
            grace = pod["spec"].get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
        if worker is not None:
            log.info("stopping pod %s/%s (grace %ss)", meta["namespace"], meta["name"], grace)
            await worker.terminate(float(grace))
        body = {
            "apiVersion": "v1",
            "kind": "DeleteOptions",
            "gracePeriodSeconds": 0,
            "preconditions": {"uid": meta["uid"]},
        }
        path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
        for _ in range(5):
            try:
                await self.api.request("DELETE", path, body=body)
                break
            except ApiError as e:
                if e.status in (404, 409):  # gone already, or a new pod of the same name
                    break
                log.warning("deleting pod %s/%s: %s", meta["namespace"], meta["name"], e)
                await asyncio.sleep(1)
        self._remove(meta["uid"])

    async def _forget(self, worker: PodWorker) -> None:
        """The pod object is gone (a forced deletion): stop its processes at once."""
        await worker.terminate(0)
        self._remove(worker.uid)

    def _remove(self, uid: str) -> None:
        self.workers.pop(uid, None)
        shutil.rmtree(self.state.pod_dir(uid), ignore_errors=True)
        shutil.rmtree(self.state.logs / uid, ignore_errors=True)

    async def shutdown(self) -> None:
        """The nodelet is stopping: stop every pod (SIGTERM, a short grace, SIGKILL), report it
        Failed as the kubelet's graceful node shutdown does, and give up after a bound."""

        async def stop(worker: PodWorker) -> None:
            if not worker.done.is_set():
                worker.node_shutdown = True
                await worker.terminate(SHUTDOWN_GRACE_S)

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(stop(w) for w in list(self.workers.values()))), SHUTDOWN_TIMEOUT_S
            )
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(BaseException):
                await task

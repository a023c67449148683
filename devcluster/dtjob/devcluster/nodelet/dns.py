"""Cluster DNS without a DNS server: every pod's /etc/hosts lists the cluster's names.

`ip netns exec <netns>` bind-mounts /etc/netns/<netns>/hosts over /etc/hosts, so glibc (Python,
and C++ code such as torch's TCPStore) resolves the names below. glibc's `files` backend matches
names exactly (search domains apply to DNS only), so the short forms a pod would reach through its
resolv.conf search list are written out too:

- headless Service `svc` in namespace `ns`: svc.ns.svc.cluster.local, svc.ns.svc, svc.ns (and `svc`
  for pods of the same namespace) -> the IPs of its ready endpoints;
- a pod with hostname `h` and subdomain `svc` (a headless Service of that name exists):
  h.svc.ns.svc.cluster.local, h.svc.ns.svc, h.svc.ns (and `h.svc` in the same namespace).

The data comes from the EndpointSlices of headless Services (the control plane's endpointslice
controller fills in each endpoint's hostname), or, when the node may not list EndpointSlices,
from the Endpoints objects of headless Services.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

from dtjob.devcluster.nodelet.kubeapi import ApiError, KubeApi, Obj, list_and_watch

log = logging.getLogger(__name__)

CLUSTER_DOMAIN = "cluster.local"
HEADLESS_LABEL = "service.kubernetes.io/headless"
SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# Without EndpointSlice access, Endpoints objects are read one by one at this period.
ENDPOINTS_POLL_S = 1.0
# ... and every this many seconds the nodelet checks whether it may watch EndpointSlices now.
RECHECK_SLICES_S = 30.0
# glibc gives up on an unknown name at once: the nameserver is the pod's own loopback, where no
# server listens (the query is refused), with one try of one second at most.
RESOLV_CONF = (
    "# dtjob nodelet: cluster names are in /etc/hosts; no DNS server.\n"
    "nameserver 127.0.0.1\n"
    "options timeout:1 attempts:1\n"
)


@dataclass(frozen=True, order=True)
class DnsRecord:
    """`name` (e.g. "svc" or "host.svc") in `namespace` resolves to `ip`."""

    namespace: str
    name: str
    ip: str


def names_for(record: DnsRecord, pod_namespace: str) -> list[str]:
    """The spellings of a record that a pod in `pod_namespace` can use."""
    base = f"{record.name}.{record.namespace}"
    names = [f"{base}.svc.{CLUSTER_DOMAIN}", f"{base}.svc", base]
    if record.namespace == pod_namespace:
        names.append(record.name)
    return names


def render_hosts(
    pod_namespace: str, pod_ip: str, hostname: str, subdomain: str | None, records: Iterable[DnsRecord]
) -> str:
    """The pod's /etc/hosts: localhost, the pod's own names (as the kubelet writes them), then the
    cluster's records."""
    own = [hostname]
    if subdomain:
        fqdn = f"{hostname}.{subdomain}.{pod_namespace}.svc"
        own = [f"{fqdn}.{CLUSTER_DOMAIN}", fqdn, hostname]
    lines = [
        "# Kubernetes-managed hosts file (dtjob nodelet).",
        "127.0.0.1\tlocalhost",
        "::1\tlocalhost ip6-localhost ip6-loopback",
        f"{pod_ip}\t{' '.join(own)}",
        "# cluster names",
    ]
    lines += [f"{r.ip}\t{' '.join(names_for(r, pod_namespace))}" for r in sorted(set(records))]
    return "\n".join(lines) + "\n"


def records_from_slices(slices: Iterable[Obj]) -> list[DnsRecord]:
    """Records of headless Services' EndpointSlices: the Service name for ready endpoints, and
    hostname.service for endpoints with a hostname (ready or not, so a gang's pods find each other
    while they start)."""
    out: set[DnsRecord] = set()
    for s in slices:
        meta = s.get("metadata", {})
        service = meta.get("labels", {}).get(SERVICE_NAME_LABEL)
        if not service or s.get("addressType", "IPv4") != "IPv4":
            continue
        for ep in s.get("endpoints") or []:
            cond = ep.get("conditions") or {}
            serving = cond.get("ready") is not False and cond.get("terminating") is not True
            for ip in ep.get("addresses") or []:
                if ep.get("hostname"):
                    out.add(DnsRecord(meta["namespace"], f"{ep['hostname']}.{service}", ip))
                if serving:
                    out.add(DnsRecord(meta["namespace"], service, ip))
    return sorted(out)


def records_from_endpoints(endpoints: Iterable[Obj]) -> list[DnsRecord]:
    """The same records from core/v1 Endpoints objects of headless Services."""
    out: set[DnsRecord] = set()
    for e in endpoints:
        ns, service = e["metadata"]["namespace"], e["metadata"]["name"]
        for subset in e.get("subsets") or []:
            for ready, key in ((True, "addresses"), (False, "notReadyAddresses")):
                for a in subset.get(key) or []:
                    if a.get("hostname"):
                        out.add(DnsRecord(ns, f"{a['hostname']}.{service}", a["ip"]))
                    if ready:
                        out.add(DnsRecord(ns, service, a["ip"]))
    return sorted(out)


class DnsWatcher:
    """Keeps the cluster's records current and calls `on_change(records)` when they change."""

    def __init__(self, api: KubeApi, on_change: Callable[[list[DnsRecord]], Awaitable[None]]) -> None:
        self.api = api
        self.on_change = on_change
        self.records: list[DnsRecord] = []
        self._objects: dict[tuple[str, str], Obj] = {}

    async def _publish(self, records: list[DnsRecord]) -> None:
        if records != self.records:
            self.records = records
            await self.on_change(records)

    async def run(self, stop: asyncio.Event) -> None:
        path = "/apis/discovery.k8s.io/v1/endpointslices"
        warned = False
        while not stop.is_set():
            try:
                await self.api.get(path, {"labelSelector": HEADLESS_LABEL, "limit": "1"})
                break
            except ApiError as e:
                if e.status != 403:
                    log.warning("listing EndpointSlices: %s; retrying", e)
                    await asyncio.sleep(ENDPOINTS_POLL_S)
                    continue
                if not warned:
                    log.warning("this node may not list EndpointSlices; reading headless Services' Endpoints")
                    warned = True
                # The permission may be granted later (`up` creates rbac.NODE_DNS_RBAC): ask again.
                await self._poll_endpoints(stop, RECHECK_SLICES_S)
            except Exception as e:
                log.warning("listing EndpointSlices: %s; retrying", e)
                await asyncio.sleep(ENDPOINTS_POLL_S)
        if warned:
            log.info("this node may list EndpointSlices now; watching them")
        await list_and_watch(
            self.api, path, {"labelSelector": HEADLESS_LABEL}, self._on_list, self._on_event, stop
        )

    async def _on_list(self, items: list[Obj]) -> None:
        self._objects = {(o["metadata"]["namespace"], o["metadata"]["name"]): o for o in items}
        await self._publish(records_from_slices(self._objects.values()))

    async def _on_event(self, kind: str, obj: Obj) -> None:
        key = (obj["metadata"]["namespace"], obj["metadata"]["name"])
        if kind == "DELETED":
            self._objects.pop(key, None)
        else:
            self._objects[key] = obj
        await self._publish(records_from_slices(self._objects.values()))

    async def _poll_endpoints(self, stop: asyncio.Event, duration: float) -> None:
        """Nodes may list/watch Services and get Endpoints by name: watch the headless Services
        and read their Endpoints each period, for `duration` seconds."""
        headless: dict[tuple[str, str], bool] = {}

        async def on_list(items: list[Obj]) -> None:
            headless.clear()
            for svc in items:
                await on_event("ADDED", svc)

        async def on_event(kind: str, svc: Obj) -> None:
            key = (svc["metadata"]["namespace"], svc["metadata"]["name"])
            if kind != "DELETED" and svc.get("spec", {}).get("clusterIP") == "None":
                headless[key] = True
            else:
                headless.pop(key, None)

        watcher = asyncio.create_task(
            list_and_watch(self.api, "/api/v1/services", {}, on_list, on_event, stop)
        )
        deadline = asyncio.get_running_loop().time() + duration
        try:
            while not stop.is_set() and asyncio.get_running_loop().time() < deadline:
                try:
                    found = [e for e in [await self._endpoints(ns, name) for ns, name in list(headless)] if e]
                    await self._publish(records_from_endpoints(found))
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("reading headless Services' Endpoints: %s", e)
                await asyncio.sleep(ENDPOINTS_POLL_S)
        finally:
            watcher.cancel()

    async def _endpoints(self, namespace: str, name: str) -> Obj | None:
        try:
            return await self.api.get(f"/api/v1/namespaces/{namespace}/endpoints/{name}")
        except ApiError as e:
            if e.status == 404:
                return None
            raise

"""Watch-based caches of what a pass reads: the jobs, their pods, nodes and the jobs' Services.

One list and then one watch per resource for the whole operator (jobs, pods and Services per
served namespace, or cluster-wide), instead of a read of the job, a list of its pods, a read of
its Service and a cluster-wide list of nodes and bound pods per pass: at 500 jobs on a 5 s timer
that was 300 list calls a second, each cluster-wide one carrying every pod of the cluster.

Each cache keeps the API server's JSON objects (never the client's models, see rawapi.py), with
what no pass reads cut off: every object's managedFields, a node's image list, a pod's volumes and,
of its containers, everything but name and resources (the environment of 1,024 workers is most
of their size).

The operator's own writes go into the cache with their response (`assume`), so the pass after a
create sees the pods it created, and the one after a delete sees them deleting, without waiting
for the watch. A watch event older than what the cache holds (by resourceVersion, which the
API server takes from etcd's revision, an integer, as client-go's MutationCache compares them)
is dropped: the cache never goes back in time, which keeps passes level-triggered on a view that
only moves forward. That holds for deletions too: the cache remembers at which resourceVersion an
object went away (`TOMBSTONES` of them), so the response of the operator's own delete that
arrives after the watch's DELETED event does not bring the pod back (seen at 256 workers: a
pass waited forever for an old worker that was long gone).

A job's status is the operator's memory: the pass after a status patch must start from what it
wrote. The patch's response goes into the cache (`assume_job`), and a watch event never takes the
cache back behind it, so the cache is as new as a read of the job for everything the operator
wrote itself; a job the cache does not hold yet (just created) is read from the API server.

Triggers: every change of a pod labelled with a job name triggers that job's pass; a node turning
NotReady or going away triggers the jobs with pods on it; a job whose spec or metadata changed
(`kubectl scale`, a deletion) triggers its own. A new job does not: its first pass comes from
kopf's event once kopf has put its finalizer on it (dtjob.operator.handlers). They run after the
cache holds the change, so the pass they trigger sees it. An event that carries the object the
cache already holds (the same resourceVersion: the watch's echo of the operator's own write)
changes nothing and triggers nothing; nor does a new pod, still Pending on no node, whose
creation by the operator is in flight (`creating`): the pass that created it saw it so already
(dtjob.operator.expectations), and its watch event often comes before the creation's answer
(500 jobs of 4 workers: 609 of 5,059 passes). A worker failing and the last pod of a generation
going away are urgent triggers: their passes skip the runner's trigger delay.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, overload

from kubernetes.client.rest import ApiException

from dtjob.operator import ownership
from dtjob.operator.capacity import node_is_ready
from dtjob.operator.jobview import (
    GROUP,
    LABEL_GENERATION,
    LABEL_JOB,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    PLURAL,
    VERSION,
)
from dtjob.operator.rawapi import RawApi, quoted

log = logging.getLogger("dtjob.operator")
Key = tuple[str, str]  # (namespace, name); namespace "" for cluster-scoped objects
Obj = dict[str, Any]
# A watch is renewed after this long (randomized by up to a fifth, so several watches of one
# operator do not all reconnect at once); the API server ends one after 30-60 min on its own.
WATCH_SECONDS = 300
# Retries of a failed list or watch: 1 s doubling to 30 s, as the operator's own backoff.
RETRY_FIRST, RETRY_MAX = 1.0, 30.0
# Deletions remembered per informer: far more than the pods one pass of a 1,024-worker gang deletes.
TOMBSTONES = 16384


class CacheNotReady(Exception):
    """A cache has not listed its resource yet (its last error, when it has one, says why)."""


def resource_version(obj: Mapping[str, Any]) -> int | None:
    try:
        return int(str((obj.get("metadata") or {}).get("resourceVersion")))
    except ValueError:
        return None


def key_of(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata") or {}
    return str(meta.get("namespace") or ""), str(meta.get("name") or "")


def _trim_meta(obj: Obj) -> Obj:
    meta = dict(obj.get("metadata") or {})
    meta.pop("managedFields", None)
    return {**obj, "metadata": meta}


def trim_pod(pod: Obj) -> Obj:
    trimmed = _trim_meta(pod)
    spec = dict(pod.get("spec") or {})
    spec.pop("volumes", None)
    for field in ("containers", "initContainers"):
        if field in spec:
            spec[field] = [
                {k: c[k] for k in ("name", "resources", "restartPolicy") if k in c} for c in spec[field] or []
            ]
    trimmed["spec"] = spec
    return trimmed


def trim_node(node: Obj) -> Obj:
    trimmed = _trim_meta(node)
    status = dict(node.get("status") or {})
    status.pop("images", None)
    trimmed["status"] = status
    return trimmed


def trim_service(service: Obj) -> Obj:
    meta = service.get("metadata") or {}
    return {
        "metadata": {
            k: meta[k] for k in ("name", "namespace", "uid", "resourceVersion", "labels") if k in meta
        }
    }


Indexer = Callable[[Obj], Iterable[Hashable]]
OnChange = Callable[[Obj | None, Obj | None], None]


class Informer:
    """A list, then a watch, of one collection (`path`, with `query` such as a label selector),
    kept as a dict of trimmed objects, with indexes, and a callback for every change."""

    def __init__(
        self,
        raw: RawApi,
        what: str,
        path: str,
        query: Mapping[str, str] | None = None,
        trim: Callable[[Obj], Obj] = _trim_meta,
        indexes: Mapping[str, Indexer] | None = None,
        on_change: OnChange | None = None,
    ) -> None:
        self.raw = raw
        self.what = what
        self.path = path
        self.query = dict(query or {})
        self.trim = trim
        self.indexers = dict(indexes or {})
        self.on_change = on_change
        self.synced = threading.Event()
        self.error: str | None = None
        self._lock = threading.Lock()
        self._items: dict[Key, Obj] = {}
        self._index: dict[str, dict[Hashable, set[Key]]] = {name: {} for name in self.indexers}
        self._gone: OrderedDict[Key, int] = OrderedDict()  # key -> resourceVersion it went away at
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._response: Any = None

    # reading ------------------------------------------------------------------------------------
    def items(self) -> list[Obj]:
        with self._lock:
            return list(self._items.values())

    def get(self, key: Key) -> Obj | None:
        with self._lock:
            return self._items.get(key)

    def by_index(self, index: str, value: Hashable) -> list[Obj]:
        with self._lock:
            keys = self._index[index].get(value, ())
            return [self._items[k] for k in keys]

    def index_values(self, index: str, key: Key) -> set[Hashable]:
        """The values under which object `key` is indexed (empty when it is not cached)."""
        with self._lock:
            obj = self._items.get(key)
            return set(self.indexers[index](obj)) if obj is not None else set()

    # writing ------------------------------------------------------------------------------------
    def assume(self, obj: Obj) -> None:
        """Put a write's response in (the API server's object after the operator's own write)."""
        self._apply("ASSUMED", self.trim(obj))

    def _bury(self, key: Key, rv: int | None) -> None:
        """Remember that `key` was gone at `rv`. Lock held."""
        if rv is None:
            return
        self._gone.pop(key, None)
        self._gone[key] = rv
        if len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)

    def _put(self, key: Key, obj: Obj | None) -> Obj | None:
        """Store (or with None remove) one object; returns the previous one. Lock held."""
        old = self._items.pop(key, None) if obj is None else self._items.get(key)
        if obj is not None:
            self._gone.pop(key, None)
        for name, indexer in self.indexers.items():
            index = self._index[name]
            if old is not None:
                for value in indexer(old):
                    keys = index.get(value)
                    if keys is not None:
                        keys.discard(key)
                        if not keys:
                            del index[value]
            if obj is not None:
                for value in indexer(obj):
                    index.setdefault(value, set()).add(key)
        if obj is not None:
            self._items[key] = obj
        return old

    def _apply(self, kind: str, obj: Obj) -> None:
        key = key_of(obj)
        with self._lock:
            cached = self._items.get(key)
            new_rv, old_rv = resource_version(obj), None if cached is None else resource_version(cached)
            # Older than what the cache holds, or the same object again (an own write's echo).
            older = new_rv is not None and old_rv is not None and new_rv < old_rv
            same = new_rv is not None and new_rv == old_rv and kind != "DELETED"
            if older or same:
                return
            if kind == "ASSUMED" and new_rv is None:
                return  # cannot be ordered against the watch: the watch brings it
            gone_at = self._gone.get(key)
            if cached is None and gone_at is not None and new_rv is not None and new_rv <= gone_at:
                return  # an object that already went away (our delete's response after its DELETED)
            old = self._put(key, None if kind == "DELETED" else obj)
            if kind == "DELETED":
                self._bury(key, new_rv)
        if self.on_change is not None and (old is not None or kind != "DELETED"):
            self.on_change(old, None if kind == "DELETED" else obj)

    def _replace(self, objects: list[Obj], list_rv: int | None) -> None:
        """A fresh list: objects it lacks are gone unless the cache holds them newer than the list
        (an own write after it); listed objects replace cached ones that are not newer."""
        listed = {key_of(o): o for o in objects}
        changes: list[tuple[Obj | None, Obj | None]] = []
        with self._lock:
            for key in list(self._items):
                if key in listed:
                    continue
                cached_rv = resource_version(self._items[key])
                if list_rv is not None and cached_rv is not None and cached_rv > list_rv:
                    continue
                changes.append((self._put(key, None), None))
                self._bury(key, list_rv)
            for key, obj in listed.items():
                cached = self._items.get(key)
                cached_rv, rv = (None if cached is None else resource_version(cached)), resource_version(obj)
                if cached_rv is not None and rv is not None and rv <= cached_rv:
                    continue
                changes.append((self._put(key, obj), obj))
        first = not self.synced.is_set()
        self.error = None
        self.synced.set()
        if self.on_change is not None and not first:
            for old, new in changes:
                self.on_change(old, new)

    # running ------------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._run, name=f"cache-{self.what}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        response = self._response
        if response is not None:
            # closing a stream another thread reads may raise; the watch ends anyway
            with contextlib.suppress(Exception):
                response.close()

    def _run(self) -> None:
        failures = 0
        rv: str | None = None
        while not self._stopped.is_set():
            try:
                if rv is None:
                    rv = self._list()
                rv = self._watch(rv)
                failures = 0
            except Exception as error:
                if self._stopped.is_set():
                    return
                failures += 1
                self.error = _describe(error, self.what)
                if isinstance(error, ApiException) and error.status == 410:
                    rv, failures = None, 0  # the watch fell behind etcd's history: list again
                    continue
                delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (failures - 1))
                log.warning("cache of %s: %s; retrying in %gs", self.what, self.error, delay)
                rv = None
                self._stopped.wait(delay)

    def _list(self) -> str:
        body = self.raw.call("GET", self.path, self.query, timeout=(10, 120))
        list_rv = str((body.get("metadata") or {}).get("resourceVersion") or "")
        self._replace([self.trim(o) for o in body.get("items") or []], _int(list_rv))
        return list_rv

    def _watch(self, rv: str) -> str | None:
        """Follows the watch from rv; returns the resourceVersion to go on from (None: list)."""
        seconds = int(WATCH_SECONDS * (1 + random.random() / 5))
        query = {
            **self.query,
            "resourceVersion": rv,
            "allowWatchBookmarks": "true",
            "timeoutSeconds": seconds,
        }
        response, events = self.raw.watch(self.path, query, timeout=(10, seconds + 30))
        self._response = response
        try:
            for event in events:
                kind, obj = event.get("type"), event.get("object") or {}
                if kind == "ERROR":
                    code = obj.get("code")
                    if code == 410:
                        return None
                    raise RuntimeError(f"watch error {code}: {obj.get('message')}")
                new_rv = str((obj.get("metadata") or {}).get("resourceVersion") or rv)
                if kind == "BOOKMARK":
                    rv = new_rv
                    continue
                if kind in {"ADDED", "MODIFIED", "DELETED"}:
                    self._apply(str(kind), self.trim(obj))
                    rv = new_rv
        finally:
            self._response = None
            response.close()
        return rv


def _int(text: str) -> int | None:
    try:
        return int(text)
    except ValueError:
        return None


def _describe(error: Exception, what: str) -> str:
    if isinstance(error, ApiException):
        try:
            message = json.loads(error.body or "{}").get("message", error.body)
        except ValueError:
            message = error.body
        return f"listing {what}: {error.status} {error.reason}: {message}"
    return f"watching {what}: {type(error).__name__}: {error}"


def _job_of(pod: Obj) -> list[tuple[str, str]]:
    meta = pod.get("metadata") or {}
    job = (meta.get("labels") or {}).get(LABEL_JOB)
    return [(str(meta.get("namespace") or ""), job)] if job else []


def _namespace_of(obj: Obj) -> list[str]:
    return [key_of(obj)[0]]


def _node_of(pod: Obj) -> list[str]:
    node = (pod.get("spec") or {}).get("nodeName")
    return [node] if node else []


class Trigger(Protocol):
    """Asks for a pass of a job. `urgent`: the change decides the pass by itself, so it runs at
    once rather than after the runner's trigger delay (see `ClusterCache._decides`)."""

    def __call__(self, namespace: str, name: str, urgent: bool = False) -> None: ...


def _phase(pod: Obj | None) -> str | None:
    return None if pod is None else (pod.get("status") or {}).get("phase")


def _generation(pod: Obj) -> str | None:
    return ((pod.get("metadata") or {}).get("labels") or {}).get(LABEL_GENERATION)


def _job_spec_or_meta(job: Obj) -> tuple[Any, Any]:
    """What a job's own trigger answers: its spec and metadata, not its status (the operator's
    own writes) nor the resourceVersion every write moves."""
    meta = {k: v for k, v in (job.get("metadata") or {}).items() if k != "resourceVersion"}
    return job.get("spec"), meta


class ReadOnFirstUse(Sequence[Obj]):
    """A list that `read()` gives at its first use (then kept: one snapshot per pass)."""

    def __init__(self, read: Callable[[], list[Obj]]) -> None:
        self._read = read
        self._items: list[Obj] | None = None

    def _list(self) -> list[Obj]:
        if self._items is None:
            self._items = self._read()
        return self._items

    @overload
    def __getitem__(self, index: int) -> Obj: ...
    @overload
    def __getitem__(self, index: slice) -> list[Obj]: ...
    def __getitem__(self, index: int | slice) -> Obj | list[Obj]:
        return self._list()[index]

    def __len__(self) -> int:
        return len(self._list())

    def __iter__(self) -> Iterator[Obj]:
        return iter(self._list())


class ClusterCache:
    """The operator's caches: the jobs (per served namespace, or cluster-wide), pods
    (cluster-wide, or only the served namespaces when the operator may not list pods everywhere),
    nodes, and the Services the operator created."""

    def __init__(self, raw: RawApi, namespaces: tuple[str, ...] = ()) -> None:
        self.raw = raw
        self.namespaces = namespaces
        self.trigger: Trigger | None = None
        # Whether the operator's creation of a pod is in flight: (namespace, job, pod) -> bool.
        self.creating: Callable[[str, str, str], bool] = lambda namespace, job, pod: False
        self._lock = threading.Lock()
        self.pods: list[Informer] = []
        self.services: list[Informer] = []
        self.jobs: list[Informer] = []
        self.nodes: Informer | None = None
        self._pods_started = threading.Event()
        self._scope_error: str | None = None

    def _serves(self, namespace: str) -> bool:
        return not self.namespaces or namespace in self.namespaces

    def _fire(self, namespace: str, job: str, urgent: bool = False) -> None:
        if self.trigger is not None and self._serves(namespace):
            self.trigger(namespace, job, urgent)

    def _pod_changed(self, old: Obj | None, new: Obj | None) -> None:
        keys = {k for obj in (old, new) if obj is not None for k in _job_of(obj)}
        if old is None and new is not None and _phase(new) == "Pending" and not _node_of(new):
            name = str((new.get("metadata") or {}).get("name"))
            keys = {(namespace, job) for namespace, job in keys if not self.creating(namespace, job, name)}
        for namespace, job in keys:
            self._fire(namespace, job, self._decides(namespace, job, old, new))

    def _decides(self, namespace: str, job: str, old: Obj | None, new: Obj | None) -> bool:
        """The two pod changes on a restart's critical path, each a pass's whole decision: a
        worker that just failed (the gang restarts) and the last pod of its generation gone (the
        next generation's pods can be created). Their passes skip the trigger delay, 0.4 s of
        every restart otherwise; the burst that follows (the other workers failing, the rest of
        the gang going away) still joins one delayed pass. A pod failing while it is deleted is
        the operator's own doing, no news."""
        if new is not None:
            deleting = (new.get("metadata") or {}).get("deletionTimestamp") is not None
            return _phase(new) == "Failed" and _phase(old) != "Failed" and not deleting
        if old is None:
            return False
        generation = _generation(old)
        with self._lock:
            informers = list(self.pods)
        return not any(
            _generation(pod) == generation
            for informer in informers
            for pod in informer.by_index("job", (namespace, job))
        )

    def _job_changed(self, old: Obj | None, new: Obj | None) -> None:
        if old is None:
            return  # a new job: kopf's event triggers its first pass (see the module's docstring)
        if new is None or _job_spec_or_meta(old) != _job_spec_or_meta(new):
            self._fire(*key_of(old or new or {}))
        if ownership.released(old, new):
            self._fire_held_behind(old)

    def _fire_held_behind(self, job: Obj) -> None:
        """The jobs of the namespace held by reconciler rule 2 on a directory that overlaps the
        one `job` just released (finished or deleted): their pass may start them now."""
        namespace, name = key_of(job)
        directory = ownership.checkpoint_dir(job)
        for other in self.jobs_in(namespace):
            if key_of(other)[1] == name or directory is None or not ownership.waiting_here(other):
                continue
            theirs = ownership.checkpoint_dir(other)
            if theirs is not None and theirs.overlaps(directory):
                self._fire(namespace, key_of(other)[1])

    def _node_changed(self, old: Obj | None, new: Obj | None) -> None:
        was_ready = old is not None and node_is_ready(old)
        if not was_ready or (new is not None and node_is_ready(new)):
            return
        name = str(((old or new) or {}).get("metadata", {}).get("name"))
        jobs = {k for informer in self.pods for pod in informer.by_index("node", name) for k in _job_of(pod)}
        for namespace, job in jobs:
            self._fire(namespace, job)

    def start(self, trigger: Trigger | None = None) -> None:
        """Starts every informer once; later calls only set the trigger."""
        with self._lock:
            if trigger is not None:
                self.trigger = trigger
            if self.nodes is not None:
                return
            selector = {"labelSelector": f"{LABEL_MANAGED_BY}={MANAGED_BY}"}
            for ns in list(self.namespaces) or [""]:
                where = f" in {ns}" if ns else ""
                path = "/api/v1/services" if not ns else f"/api/v1/namespaces/{quoted(ns)}/services"
                services = Informer(self.raw, f"services{where}", path, selector, trim=trim_service)
                self.services.append(services)
                jobs = f"/apis/{GROUP}/{VERSION}" + (f"/namespaces/{quoted(ns)}" if ns else "") + f"/{PLURAL}"
                self.jobs.append(
                    Informer(
                        self.raw,
                        f"jobs{where}",
                        jobs,
                        indexes={"namespace": _namespace_of},
                        on_change=self._job_changed,
                    )
                )
            self.nodes = Informer(
                self.raw, "nodes", "/api/v1/nodes", trim=trim_node, on_change=self._node_changed
            )
            for informer in [*self.jobs, *self.services, self.nodes]:
                informer.start()
        threading.Thread(target=self._start_pods, name="cache-pods-scope", daemon=True).start()

    def _start_pods(self) -> None:
        """Pods cluster-wide when the operator may list them everywhere (capacity then counts
        every pod on a node), else one informer per served namespace. Asking may fail while the
        API server is unreachable: asked again with backoff."""
        failures = 0
        while True:
            try:
                everywhere = self._pods_everywhere()
                break
            except Exception as error:
                failures += 1
                self._scope_error = _describe(error, "pods")
                delay = min(RETRY_MAX, RETRY_FIRST * 2 ** (failures - 1))
                log.warning("cache of pods: %s; retrying in %gs", self._scope_error, delay)
                time.sleep(delay)
        pod_indexes: dict[str, Indexer] = {"job": _job_of, "node": _node_of}
        informers = []
        for ns in [""] if everywhere else list(self.namespaces):
            path = "/api/v1/pods" if not ns else f"/api/v1/namespaces/{quoted(ns)}/pods"
            what = f"pods{' in ' + ns if ns else ''}"
            informers.append(
                Informer(
                    self.raw, what, path, trim=trim_pod, indexes=pod_indexes, on_change=self._pod_changed
                )
            )
        with self._lock:
            self.pods = informers
        for informer in informers:
            informer.start()
        self._pods_started.set()

    def _pods_everywhere(self) -> bool:
        """Whether to cache pods cluster-wide: always for an all-namespaces operator; for one
        serving some namespaces when it may (capacity then counts every pod on a node)."""
        if not self.namespaces:
            return True
        try:
            self.raw.call("GET", "/api/v1/pods", {"limit": 1}, timeout=(10, 30))
        except ApiException as e:
            if e.status == 403:
                return False
            raise
        return True

    def stop(self) -> None:
        for informer in self.all():
            informer.stop()

    def all(self) -> list[Informer]:
        return [*self.pods, *self.jobs, *self.services, *([self.nodes] if self.nodes else [])]

    def wait_synced(self, timeout: float) -> None:
        """Returns once every cache has listed; raises CacheNotReady after `timeout`."""
        self.start()
        deadline = time.monotonic() + timeout
        if not self._pods_started.wait(timeout):
            why = self._scope_error or f"still listing after {timeout:g}s"
            raise CacheNotReady(f"the operator's cache of pods is not ready: {why}")
        for informer in self.all():
            if not informer.synced.wait(max(0.0, deadline - time.monotonic())):
                why = informer.error or f"still listing after {timeout:g}s"
                raise CacheNotReady(f"the operator's cache of {informer.what} is not ready: {why}")

    # what a pass reads ----------------------------------------------------------------------------
    def job(self, namespace: str, name: str) -> Obj | None:
        """The cached job; None when no cache of its namespace has listed yet or it holds no such
        job (then read it from the API server, and `assume_job` the answer)."""
        informer = self._informer(self.jobs, namespace)
        if informer is None or not informer.synced.is_set():
            return None
        return informer.get((namespace, name))

    def jobs_in(self, namespace: str) -> list[Obj]:
        """The cached jobs of one namespace."""
        return [j for informer in self.jobs for j in informer.by_index("namespace", namespace)]

    def job_pods(self, namespace: str, job: str) -> list[Obj]:
        pods = [p for informer in self.pods for p in informer.by_index("job", (namespace, job))]
        return sorted(pods, key=lambda p: str((p.get("metadata") or {}).get("name")))

    def bound_pods(self) -> ReadOnFirstUse:
        """Every pod bound to a node, read from the cache when first used: only a pass that sizes
        a generation counts free capacity, and a list of every pod built for each pass was 15%
        of the operator's CPU with 500 jobs of 4 workers (py-spy), a cost growing with jobs x pods."""
        return ReadOnFirstUse(
            lambda: [
                p for informer in self.pods for p in informer.items() if (p.get("spec") or {}).get("nodeName")
            ]
        )

    def node_list(self) -> list[Obj]:
        return sorted(self.nodes.items() if self.nodes else [], key=lambda n: str(n["metadata"].get("name")))

    def service_exists(self, namespace: str, name: str) -> bool:
        return any(informer.get((namespace, name)) is not None for informer in self.services)

    def assume_pod(self, pod: Obj) -> None:
        self._assume(self.pods, pod)

    def assume_service(self, service: Obj) -> None:
        self._assume(self.services, service)

    def assume_job(self, job: Obj) -> None:
        self._assume(self.jobs, job)

    def _assume(self, informers: list[Informer], obj: Obj) -> None:
        informer = self._informer(informers, str((obj.get("metadata") or {}).get("namespace") or ""))
        if informer is not None:
            informer.assume(obj)

    @staticmethod
    def _informer(informers: list[Informer], namespace: str) -> Informer | None:
        """The informer of `informers` that covers `namespace` (a cluster-wide one covers all)."""
        for informer in informers:
            if "/namespaces/" not in informer.path or f"/namespaces/{quoted(namespace)}/" in informer.path:
                return informer
        return None

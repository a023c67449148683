"""kopf peering: the CRDs and the peering object, so that of several operator replicas exactly one
is active (the others pause until it stops renewing its heartbeat).

kopf expects `kopf.dev/v1` ClusterKopfPeering (cluster-wide operators) or KopfPeering
(namespaced ones) to exist; `ensure_peering` creates the CRD and the named object when missing.
"""

from __future__ import annotations

import functools
import json
import logging
import time
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

log = logging.getLogger("dtjob.operator")
PEERING_GROUP, PEERING_VERSION = "kopf.dev", "v1"


def peering_crd(scope: str) -> dict[str, Any]:
    kind = "ClusterKopfPeering" if scope == "Cluster" else "KopfPeering"
    plural = kind.lower() + "s"
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{PEERING_GROUP}"},
        "spec": {
            "group": PEERING_GROUP,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": kind.lower()},
            "versions": [
                {
                    "name": PEERING_VERSION,
                    "served": True,
                    "storage": True,
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "x-kubernetes-preserve-unknown-fields": True,
                        }
                    },
                }
            ],
        },
    }


def _ensure_crd(scope: str) -> str:
    crd = peering_crd(scope)
    ext = client.ApiextensionsV1Api()
    plural: str = crd["spec"]["names"]["plural"]
    try:
        ext.create_custom_resource_definition(crd)  # type: ignore[arg-type]
        log.info("created CRD %s", crd["metadata"]["name"])
    except ApiException as e:
        if e.status == 403:
            # Least-privilege installs (the helm chart) ship this CRD and grant no CRD rights.
            log.info("not allowed to create CRD %s; using the installed one", crd["metadata"]["name"])
            return plural
        if e.status != 409:
            raise
    # The API server serves a new CRD's resource a moment after accepting it.
    for _ in range(50):
        served = ext.read_custom_resource_definition(crd["metadata"]["name"])
        conditions = served.status.conditions if served.status else None
        if any(c.type == "Established" and c.status == "True" for c in conditions or []):
            break
        time.sleep(0.1)
    return plural


def ensure_peering(name: str, clusterwide: bool, namespaces: list[str]) -> None:
    custom = client.CustomObjectsApi()
    if clusterwide:
        plural = _ensure_crd("Cluster")
        body = {
            "apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}",
            "kind": "ClusterKopfPeering",
            "metadata": {"name": name},
        }
        try:
            custom.create_cluster_custom_object(PEERING_GROUP, PEERING_VERSION, plural, body)
        except ApiException as e:
            _tolerate_existing_or_forbidden(e, body)
        read = functools.partial(
            custom.get_cluster_custom_object, PEERING_GROUP, PEERING_VERSION, plural, name
        )
        _check_readable(read, body)
        return
    plural = _ensure_crd("Namespaced")
    for namespace in namespaces:
        body = {
            "apiVersion": f"{PEERING_GROUP}/{PEERING_VERSION}",
            "kind": "KopfPeering",
            "metadata": {"name": name, "namespace": namespace},
        }
        try:
            custom.create_namespaced_custom_object(PEERING_GROUP, PEERING_VERSION, namespace, plural, body)
        except ApiException as e:
            _tolerate_existing_or_forbidden(e, body)
        read = functools.partial(
            custom.get_namespaced_custom_object, PEERING_GROUP, PEERING_VERSION, namespace, plural, name
        )
        _check_readable(read, body)


def _tolerate_existing_or_forbidden(error: ApiException, body: dict[str, Any]) -> None:
    """409: it exists. 403: a least-privilege install (the helm chart) creates the peering object
    itself and grants only get/list/watch/patch on it; kopf reports it if it is missing."""
    if error.status == 403:
        kind, name = body["kind"], body["metadata"]["name"]
        log.info("not allowed to create %s %s; expecting the installer's", kind, name)
    elif error.status != 409:
        raise error


def _check_readable(read: Callable[[], object], body: dict[str, Any]) -> None:
    """Say at startup, in the log, when the peering object cannot be read or does not exist.

    kopf pauses every handler until it has checked in with its peers. Without the RBAC rule on the
    peering resource it usually logs the refused request, but not always: twice here (kopf 1.45) it
    logged nothing for over 100 s after its startup, and the operator looked idle for no reason.
    """
    kind, name = body["kind"], body["metadata"]["name"]
    try:
        read()
    except ApiException as e:
        if e.status == 403:
            log.error(
                "%s - the operator's role needs get, list, watch and patch on %ss.%s; until then kopf "
                "pauses every handler (fix: install with the chart's RBAC, or add that rule)",
                _api_message(e),
                kind.lower(),
                PEERING_GROUP,
            )
        elif e.status == 404:
            log.error(
                "%s %s does not exist; kopf pauses every handler until it does (fix: create it, or "
                "run with --standalone)",
                kind,
                name,
            )
        else:
            raise


def _api_message(error: ApiException) -> str:
    """The API server's own sentence from an error, e.g. 'x is forbidden: User ... cannot get ...'."""
    try:
        message = json.loads(error.body or "{}").get("message")
    except ValueError:
        message = None
    return str(message or error.reason)

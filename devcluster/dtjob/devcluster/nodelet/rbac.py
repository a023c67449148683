"""RBAC that lets nodelets watch EndpointSlices, for `dtjob devcluster up` to create as admin:

    for path, obj in NODE_DNS_RBAC:
        api.create(path, obj)  # 409 (exists) is fine

(or apply NODE_DNS_RBAC_YAML, the same objects as YAML).

The Node authorizer lets a node list/watch Services and get Endpoints by name, but not list
EndpointSlices; without this binding each nodelet falls back to reading every headless Service's
Endpoints once a second (dns.DnsWatcher). With it, pods' /etc/hosts follow a watch instead: less
load on the API server and names that appear as soon as the endpointslice controller writes them.
In a real cluster CoreDNS holds the same permission.
"""

from __future__ import annotations

from typing import Any

import yaml

RBAC_API = "rbac.authorization.k8s.io"
NAME = "dtjob:nodelet-dns"

NODE_DNS_RBAC: list[tuple[str, dict[str, Any]]] = [
    (
        f"/apis/{RBAC_API}/v1/clusterroles",
        {
            "apiVersion": f"{RBAC_API}/v1",
            "kind": "ClusterRole",
            "metadata": {"name": NAME},
            "rules": [
                {
                    "apiGroups": ["discovery.k8s.io"],
                    "resources": ["endpointslices"],
                    "verbs": ["list", "watch"],
                }
            ],
        },
    ),
    (
        f"/apis/{RBAC_API}/v1/clusterrolebindings",
        {
            "apiVersion": f"{RBAC_API}/v1",
            "kind": "ClusterRoleBinding",
            "metadata": {"name": NAME},
            "roleRef": {"apiGroup": RBAC_API, "kind": "ClusterRole", "name": NAME},
            "subjects": [{"apiGroup": RBAC_API, "kind": "Group", "name": "system:nodes"}],
        },
    ),
]

# The same objects as one YAML stream (what `dtjob devcluster up` applies).
NODE_DNS_RBAC_YAML: str = yaml.safe_dump_all([obj for _, obj in NODE_DNS_RBAC], sort_keys=False)

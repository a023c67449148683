"""RBAC that lets nodelets watch EndpointSlices, for `dtjob devcluster up` to apply as admin.

The Node authorizer lets a node list/watch Services and get Endpoints by name, but not list
EndpointSlices; without this binding each nodelet falls back to reading every headless Service's
Endpoints once a second (dns.DnsWatcher). With it, pods' /etc/hosts follow a watch instead: less
load on the API server and names that appear as soon as the endpointslice controller writes them.
In a real cluster CoreDNS holds the same permission.
"""

from __future__ import annotations

NODE_DNS_RBAC_YAML = """\
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRole
metadata:
  name: dtjob:nodelet-dns
rules:
  - apiGroups: [discovery.k8s.io]
    resources: [endpointslices]
    verbs: [list, watch]
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: dtjob:nodelet-dns
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: dtjob:nodelet-dns
subjects:
  - apiGroup: rbac.authorization.k8s.io
    kind: Group
    name: system:nodes
"""

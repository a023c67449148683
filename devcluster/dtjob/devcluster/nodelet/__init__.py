"""The nodelet: dtjob's own small kubelet, which runs the pods bound to its Node as local processes.

__main__.py    command line; start-up (cleanup of a previous run, registration) and shutdown
config.py      the flags (the contract with `dtjob devcluster up`)
kubeapi.py     async REST client and the list+watch loop
node.py        Node registration, status heartbeats, node Lease
manager.py     watches the node's pods, starts workers, deletions, NodeLost after a restart
pods.py        one pod's life: volumes, sandbox, (init) containers, restarts, status, SIGTERM
status.py      container statuses and pod conditions
sandbox.py     netns, veth, pod IP, /etc/netns files, the launch command line
container_init.py runs inside the pod's namespaces: mounts, hostname, user, exec
env.py         env (fieldRef, configMap/secret refs), $(VAR) expansion, command line
volumes.py     emptyDir, hostPath, PVC, configMap, secret, downwardAPI, projected token
dns.py         cluster names in every pod's /etc/hosts (from headless Services' endpoints)
logs_server.py kubelet API: /containerLogs for `kubectl logs [-f]`
state.py       what is recorded under --state-dir
cleanup.py     kill_node(state_dir): processes, netns, veths, /etc/netns of this node
"""

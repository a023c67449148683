"""dtjob and Kubeflow's PyTorchJob, measured on the same devcluster (python -m bench.peers)."""

"""A real Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler)
run as plain local processes, with fake Nodes: what `make test` and `make demo` stand on."""

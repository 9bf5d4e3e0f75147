"""A container runtime for a real kubelet, without containers: the CRI (k8s.io/cri-api v1) served
from memory, so the real-kubelet tests can run the kubelet itself, with its DRA manager and plugin
watcher, on a machine with no containerd.

It keeps pods and containers as records and never runs a process. Like containerd, it resolves
the CDI device names the kubelet passes in ``ContainerConfig.CDI_devices`` against the CDI spec
directories and fails ``CreateContainer`` when one does not resolve; each container keeps the
edits its names resolved to, for the tests to read. Stubs: ``fakecri/gen`` (``make protos``)."""

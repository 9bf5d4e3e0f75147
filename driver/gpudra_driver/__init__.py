"""gpudra node agent: NVML discovery, ResourceSlice publishing and the kubelet DRA plugin."""

"""gpudra operator: reconciles GpuDraConfig into the agent DaemonSet and DRA DeviceClasses."""

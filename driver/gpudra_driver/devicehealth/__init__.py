"""Device health: NVML events and a periodic probe in, device taints out.

* :mod:`~gpudra_driver.devicehealth.plan`: the pure decisions (observations -> per-GPU health -> taints,
  recovery after a quiet period, what to tell people);
* :mod:`~gpudra_driver.devicehealth.scope`: which devices a fault reaches (pure): the GPU, a MIG
  device, or the dynamic MIG placements on a faulty instance's memory; which XIDs stay in an instance;
* :mod:`~gpudra_driver.devicehealth.apply`: the I/O shell (an NVML event thread, the probe, publishing);
* :mod:`~gpudra_driver.devicehealth.feed`: each device's health for the kubelet (KEP-4680, pod status);
* :mod:`~gpudra_driver.publishing.apisupport`: whether the API server keeps device taints (1.35 drops them);
* :mod:`~gpudra_driver.devicehealth.xids`: what an XID means.

docs/health.md is the user's side of it.
"""

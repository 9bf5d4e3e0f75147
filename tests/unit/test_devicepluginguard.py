"""Which Node resources mean NVIDIA's device plugin hands out this node's GPUs."""

from __future__ import annotations

from gpudra_driver.devicepluginguard import advertised_gpus


def test_every_resource_name_the_device_plugin_uses_counts() -> None:
    assert advertised_gpus({"status": {"allocatable": {"nvidia.com/gpu": "8"}}}) == {"nvidia.com/gpu": 8}
    # time-slicing with renamed resources, and the MIG strategy "mixed"
    assert advertised_gpus({"status": {"allocatable": {"nvidia.com/gpu.shared": "32"}}}) == {"nvidia.com/gpu.shared": 32}
    assert advertised_gpus({"status": {"allocatable": {"nvidia.com/mig-1g.10gb": "7", "nvidia.com/mig-3g.40gb": "0"}}}) \
        == {"nvidia.com/mig-1g.10gb": 7}
    # nothing of the device plugin's, or a zero count (the plugin gone, the kubelet not yet updated)
    assert advertised_gpus({"status": {"allocatable": {"cpu": "64", "nvidia.com/gpu": "0"}}}) == {}
    assert advertised_gpus({"status": {"allocatable": {"example.com/gpu": "1"}}}) == {}
    assert advertised_gpus(None) == {}

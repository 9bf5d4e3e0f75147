"""What the operator and the node agent agree on at run time, without importing each other: the
source of the agent's Events (the operator lists them by it), the reasons it posts that the operator
reads, and where the MPS supervisor listens (the agent talks to it, the operator's DaemonSet probes
it)."""

from __future__ import annotations

# The agent's warning, and its all-clear, when a device plugin advertises nvidia.com/gpu on its node.
DEVICE_PLUGIN_CONFLICT = "DevicePluginConflict"
DEVICE_PLUGIN_RESOLVED = "DevicePluginConflictResolved"

# In the MPS root (<plugin directory>/mps): the supervisor's socket, one JSON line each way.
MPS_SUPERVISOR_SOCKET = "supervisor.sock"


def event_source(driver: str) -> str:
    """The agent's Events' ``source.component``: per driver, so each GpuDraConfig's operator finds
    its agents' events with one field selector (``source=gpudra-agent/<driver>``)."""
    return f"gpudra-agent/{driver}"

# The agent's warning, and its all-clear, when the API server drops counter sets (1.35), so that
# dynamic MIG falls back to static MIG on its node.
DYNAMIC_MIG_UNSUPPORTED = "DynamicMigUnsupported"
DYNAMIC_MIG_SUPPORTED = "DynamicMigSupported"

# The agent's warning, and its all-clear, about GPUs on its node that do not match their MIG mode
# (MIG mode disabled under dynamic, enabled under whole, MIG devices someone else made).
MIG_NOT_READY = "MigNotReady"
MIG_READY = "MigReady"

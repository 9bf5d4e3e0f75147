"""The kubelet DRA plugin: registration and DRAPlugin (v1, v1beta1) over unix sockets.

One concern per module, the shape of dra-example-driver's kubelet plugin:

* ``protos/`` + ``gen/``: wire-compatible copies of the kubelet's .proto files and their stubs.
* :mod:`.registration`: the plugin-registration service (GetInfo / NotifyRegistrationStatus).
* :mod:`.service`: grpc.aio servicers for v1 and v1beta1 over one implementation.
* :mod:`.plugin`: the I/O shell: sockets, the claim GET.
* :mod:`.state`: prepare and unprepare under the node lock (checkpoint, CDI specs).
* :mod:`.recovery`: start-up reconciliation of the checkpoint and the CDI directory.
* :mod:`.prepare` (pure): claim checks and the prepare plan (shares, sharing settings).
* :mod:`.gpusettings` (pure): the compute mode and time slice each GPU needs, from the checkpoint.
* :mod:`.gpucontrol`: applies them (NVML, the driver root's nvidia-smi).
* :mod:`.devicenodes` (pure): which /dev nodes make a device usable.
* :mod:`.cdi`: CDI spec content (pure) and the spec directory (atomic files).
* :mod:`.checkpoint`: the crash-safe checkpoint: transitions and reconciliation (pure), file I/O.
* :mod:`.sweep`: releases claims whose ResourceClaim is gone or no longer allocated here.
* :mod:`.locking`: the per-node file lock that serialises overlapping agent instances.
* :mod:`.fsutil`: atomic file replacement (temp file, rename; no fsync, see its docstring).
* :mod:`.faults`: a test-only fault hook (SIGKILL at a named point).
* :mod:`.kubelet_client`: the kubelet's side of the protocol, for tests, bench and debugging.
"""

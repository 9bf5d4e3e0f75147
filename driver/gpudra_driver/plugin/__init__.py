"""The kubelet DRA plugin: registration and DRAPlugin (v1, v1beta1) over unix sockets.

One concern per module, the shape of dra-example-driver's kubelet plugin:

* ``protos/`` + ``gen/``: wire-compatible copies of the kubelet's .proto files and their stubs.
* :mod:`.registration`: the plugin-registration service (GetInfo / NotifyRegistrationStatus).
* :mod:`.service`: grpc.aio servicers for v1 and v1beta1 over one implementation.
* :mod:`.plugin`: the I/O shell: sockets, the claim GET.
* :mod:`.state`: prepare and unprepare: the order of their steps (crash safety), composing:
  :mod:`.calllocks` (one call at a time, then the node lock), :mod:`.batching` (queued prepare
  calls done as one batch), :mod:`.specs` (each claim's CDI spec written or removed),
  :mod:`.rollback` (unfinished prepares undone) and :mod:`gpudra_driver.plugin.sharing.controller`
  (GPU sharing settings and MPS daemons, from the checkpoint).
* :mod:`.recovery`: start-up reconciliation of the checkpoint and the CDI directory.
* :mod:`.allocation`: a claim read as tenant input (bounded, configs decoded) before any lock.
* :mod:`.plan` (pure): claim checks and the prepare plan (shares, sharing settings).
* :mod:`.devicenodes` (pure): which /dev nodes make a device usable.
* :mod:`.cdi`: CDI spec content (pure) and the spec directory (atomic files).
* :mod:`.checkpoint`: the crash-safe checkpoint: transitions and reconciliation (pure), file I/O.
* :mod:`.sweep`: releases claims whose ResourceClaim is gone or no longer allocated here.
* dynamic MIG: :mod:`.miginstances` (GPU and compute instances through NVML), :mod:`.miglifecycle`
  (made and destroyed around the checkpoint's two phases), :mod:`.migrepair` (made again where a
  GPU reset or a driver reload destroyed a prepared claim's), :mod:`.migmodeswitch` (a dynamic
  GPU's MIG mode off for a claim of its whole GPU, and on again).
* :mod:`.locking`: the per-node file lock that serialises overlapping agent instances.
* :mod:`.fsutil`: atomic file replacement (temp file, rename; no fsync, see its docstring).
* :mod:`.faults`: a test-only fault hook (SIGKILL at a named point).
* the kubelet's side of the protocol, for tests, bench and debugging, is gpudra_dev.kubelet_client.
"""

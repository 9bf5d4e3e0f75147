"""Sharing a GPU between claims: :mod:`.plan`, pure (the settings each GPU must have, given the
checkpoint: compute mode, time slice), and :mod:`.apply`, its I/O half (NVML and nvidia-smi);
:mod:`.mps`, the MPS control daemons; :mod:`.controller`, both kept as the checkpoint says."""

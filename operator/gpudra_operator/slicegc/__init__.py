"""The ResourceSlice garbage collector of a GpuDraConfig: :mod:`.plan`, its one pure decision (which
of a driver's slices are stale), and :mod:`.apply`, its I/O half (load, decide, delete with
preconditions, report)."""

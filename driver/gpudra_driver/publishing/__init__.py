"""Publishing this node's devices as ResourceSlices. Every concern of the agent and the operator
that decides and then acts is split the same way: :mod:`.plan`, pure (what to write so the API
server holds exactly this node's pool), and :mod:`.apply`, its I/O half (the publisher: writes the
difference, restores what others change). :mod:`.slices` builds the slices from the device model;
:mod:`.rescan` rediscovers the GPUs on an interval."""

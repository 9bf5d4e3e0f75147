"""MPS control daemons for claims that share a GPU through MPS: :mod:`.plan`, pure (which daemons
the checkpoint asks for, and what each looks like), :mod:`.apply`, the agent's I/O half (the spec
files the supervisor converges on), :mod:`.supervisor`, the process that runs the daemons outside
the agent, with :mod:`.mounts` (their directories) and :mod:`.processes` (which process is which)."""

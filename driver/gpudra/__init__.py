"""The `gpudra` command line (:mod:`gpudra.cli`): it only dispatches, by name, to the component
that owns each subcommand, so that each image carries it without the other component's code."""

"""What the operator and the node agent share, importing neither: the Kubernetes client adapter
(:mod:`.kubeapi`), Kubernetes' limits (:mod:`.limits`), quantities (:mod:`.quantity`), the device
model (:mod:`.devicemodel`, :mod:`.consumable`), field diffs (:mod:`.diff`), the /metrics server
(:mod:`.metrics_http`). import-linter keeps it below both (`make typecheck`)."""

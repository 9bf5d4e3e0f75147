"""Chaos under load: a local GPU cluster restarted piece by piece while pods with claims come and
go, its invariants checked throughout and at the end (docs/chaos.md; `make chaos`)."""

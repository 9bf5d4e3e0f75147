"""Generated from ../protos/api.proto (k8s.io/cri-api v0.35.4) by hack/gen-protos.sh; do not edit."""

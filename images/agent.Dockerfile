# syntax=docker/dockerfile:1.7
# The gpudra node agent image (DRA kubelet plugin), for linux/amd64 and linux/arm64: `make
# image-agent` (PLATFORM=linux/arm64 for the other architecture). The operator's DaemonSet runs it
# as `gpudra agent ...`; its default name is spec.agent.image's default (ghcr.io/gpudra/gpudra).
# By hand, from the wheels `make wheels` puts in dist/, which is the build context:
#
#   make wheels && docker buildx build --platform linux/amd64,linux/arm64 -f images/agent.Dockerfile dist/
#
# It installs the pure wheel (gpudra-<version>-py3-none-any.whl): the agent runs no
# gpudra-allocator, so it carries none of its binaries (about 100 MB), and of the wheel only the
# agent (gpudra.component). Same two stages as the
# operator image. No NVIDIA libraries are baked in: NVML comes from the host's driver root, mounted
# read-only at /driver-root by the DaemonSet.
# `make images` builds it through hack/images.sh: skipped when unchanged, and on a stand-in base
# (PYTHON_IMAGE=localhost/gpudra-python-base:bookworm) where this one cannot be pulled; releases use
# this one (docs/deploy.md, "Building the images").
ARG PYTHON_IMAGE=python:3.13.9-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
COPY . /dist/
RUN set -eu; \
    set -- /dist/gpudra-*-py3-none-any.whl; \
    if [ ! -f "$1" ]; then \
      echo "no gpudra-*-py3-none-any.whl in the build context: run make wheels (hack/wheels.sh) and build with dist/ as the context" >&2; \
      exit 1; \
    fi; \
    if [ $# -ne 1 ]; then echo "several pure gpudra wheels in the build context: $*" >&2; exit 1; fi; \
    pip wheel --no-cache-dir --wheel-dir /wheels "$1"

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The DaemonSet runs the agent (and the MPS supervisor) with PYTHONOPTIMIZE=2 (no docstrings in
# memory: docs/agent.md, "Footprint"), so the image carries bytecode for that level (compileall,
# below), for the standard library too (the official python images delete theirs): without it
# every start compiles its imports from source, which takes longer and leaves the process larger.
# The agent alone: the CLI, the shared core and gpudra_driver, with the agent's requirements
# (gpudra.component: the wheel's agent-image extra); no operator, kopf or Jinja2.
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --no-deps --find-links=/wheels gpudra \
    && python3 -m gpudra.component agent > /tmp/requirements.txt \
    && pip install --no-cache-dir --no-index --find-links=/wheels -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && (pip uninstall --yes --quiet pip setuptools wheel || true) \
    && python3 -OO -m compileall -q -j 0 \
         $(python3 -c 'import sysconfig; p = sysconfig.get_paths(); print(p["stdlib"], p["purelib"])')
# Root, deliberately: a DRA kubelet plugin creates sockets and CDI specs in root-owned host
# directories (/var/lib/kubelet/plugins*, /var/run/cdi) and opens /dev/nvidia* device nodes. The
# privilege itself (privileged: true, the hostPath mounts) is granted by the DaemonSet the operator
# renders, in a namespace labelled for it, and nowhere else (docs/design.md, "The agent DaemonSet").
USER 0:0
EXPOSE 8082 8083
ENTRYPOINT ["gpudra"]
CMD ["agent"]

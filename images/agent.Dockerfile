# syntax=docker/dockerfile:1.7
# The gpudra node agent image (DRA kubelet plugin): `make image-agent`. The operator's DaemonSet
# runs it as `gpudra agent ...`; its default name is spec.agent.image's default (ghcr.io/gpudra/gpudra).
#
# Same two stages as the operator image. No NVIDIA libraries are baked in: NVML comes from the
# host's driver root, mounted read-only at /driver-root by the DaemonSet.
# `make images` builds it through hack/images.sh: skipped when unchanged, and on a stand-in base
# (PYTHON_IMAGE=localhost/gpudra-python-base:bookworm) where this one cannot be pulled; releases use
# this one (docs/deploy.md, "Building the images").
ARG PYTHON_IMAGE=python:3.13.9-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY driver ./driver
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels gpudra \
    && (pip uninstall --yes --quiet pip setuptools wheel || true)
# Root, deliberately: a DRA kubelet plugin creates sockets and CDI specs in root-owned host
# directories (/var/lib/kubelet/plugins*, /var/run/cdi) and opens /dev/nvidia* device nodes. The
# privilege itself (privileged: true, the hostPath mounts) is granted by the DaemonSet the operator
# renders, in a namespace labelled for it, and nowhere else (docs/design.md, "The agent DaemonSet").
USER 0:0
EXPOSE 8082 8083
ENTRYPOINT ["gpudra"]
CMD ["agent"]

# syntax=docker/dockerfile:1.7
# The gpudra operator image: `make image-operator` (or `docker build -f images/operator.Dockerfile .`).
#
# Multi-stage: wheels for gpudra and its dependencies are built in the first stage; the runtime stage
# installs them from a bind mount (no wheels, compilers or pip caches in a layer). The base is
# pinned to a Python patch release; release builds should pin its digest too
# (--build-arg PYTHON_IMAGE=python:3.13.9-slim-bookworm@sha256:...).
# `make images` builds it through hack/images.sh: skipped when unchanged, and on a stand-in base
# (PYTHON_IMAGE=localhost/gpudra-python-base:bookworm) where this one cannot be pulled; releases use
# this one (docs/deploy.md, "Building the images").
ARG PYTHON_IMAGE=python:3.13.9-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY pyproject.toml README.md ./
COPY operator ./operator
COPY driver ./driver
RUN pip wheel --no-cache-dir --wheel-dir /wheels ".[operator]"

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --find-links=/wheels "gpudra[operator]" \
    && (pip uninstall --yes --quiet pip setuptools wheel || true)
# Non-root, numeric so Kubernetes can verify runAsNonRoot without a passwd lookup; the Deployment's
# restricted securityContext (read-only root, no capabilities) needs nothing from the image.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["gpudra"]
CMD ["operator", "--liveness-port=8080", "--metrics-port=8081", "--log-format=json"]

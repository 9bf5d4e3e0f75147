# syntax=docker/dockerfile:1.7
# The gpudra operator image, for linux/amd64 and linux/arm64: `make image-operator` (this machine's
# architecture; PLATFORM=linux/arm64 for the other), or by hand from the wheels `make wheels` puts
# in dist/, which is the build context:
#
#   make wheels && docker buildx build --platform linux/amd64,linux/arm64 -f images/operator.Dockerfile dist/
#
# The context is a directory of wheels, nothing else: the image installs the gpudra wheel of its
# own platform (`uname -m` in the build: x86_64 or aarch64), which carries that platform's
# gpudra-allocator binaries (Kubernetes' own DRA allocator and CEL; the operator runs them for the
# per-class device counts). A build for the other architecture runs its RUN steps under emulation
# (qemu-user-static with binfmt_misc; docs/deploy.md, "Building the images").
#
# Two stages: the first resolves gpudra's dependencies into wheels for the target platform; the
# runtime stage installs them from a bind mount (no wheels, compilers or pip caches in a layer). The
# base is pinned to a Python patch release; release builds should pin its digest too
# (--build-arg PYTHON_IMAGE=python:3.13.9-slim-bookworm@sha256:...).
# `make images` builds it through hack/images.sh: skipped when unchanged, and on a stand-in base
# (PYTHON_IMAGE=localhost/gpudra-python-base:bookworm) where this one cannot be pulled; releases use
# this one (docs/deploy.md, "Building the images").
ARG PYTHON_IMAGE=python:3.13.9-slim-bookworm

FROM ${PYTHON_IMAGE} AS wheels
COPY . /dist/
RUN set -eu; arch="$(uname -m)"; \
    set -- /dist/gpudra-*-py3-none-*manylinux_2_17_"$arch"*.whl; \
    if [ ! -f "$1" ]; then \
      echo "no gpudra wheel for linux $arch in the build context: run make wheels (hack/wheels.sh) and build with dist/ as the context" >&2; \
      exit 1; \
    fi; \
    if [ $# -ne 1 ]; then echo "several gpudra wheels for linux $arch in the build context: $*" >&2; exit 1; fi; \
    pip wheel --no-cache-dir --wheel-dir /wheels "$1"

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
# The last check: the binaries of every supported release are there and run on this platform.
# The operator alone: the CLI, the shared core and gpudra_operator, with the operator's requirements
# (gpudra.component: the wheel's operator-image extra); no agent, gRPC, NVML bindings or uvloop.
RUN --mount=type=bind,from=wheels,source=/wheels,target=/wheels \
    pip install --no-cache-dir --no-index --no-deps --find-links=/wheels gpudra \
    && python3 -m gpudra.component operator > /tmp/requirements.txt \
    && pip install --no-cache-dir --no-index --find-links=/wheels -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && (pip uninstall --yes --quiet pip setuptools wheel || true) \
    && bin="$(python3 -c 'import gpudra_operator, os; print(os.path.join(os.path.dirname(gpudra_operator.__file__), "bin"))')" \
    && set -- "$bin"/gpudra-allocator-1.* && [ -x "$1" ] \
    && for b in "$@"; do echo "$(basename "$b"): $("$b" -version)"; done
# Non-root, numeric so Kubernetes can verify runAsNonRoot without a passwd lookup; the Deployment's
# restricted securityContext (read-only root, no capabilities) needs nothing from the image.
USER 65532:65532
EXPOSE 8080 8081
ENTRYPOINT ["gpudra"]
CMD ["operator", "--liveness-port=8080", "--metrics-port=8081", "--log-format=json"]

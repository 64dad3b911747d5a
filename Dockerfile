# The image deploy/k8s runs (dspark/triton:0.1.0): dspark, its backends and the tritonserver
# that the nvidia-pytriton wheel bundles, built from this checkout:
#
#   docker build -t dspark/triton:0.1.0 .
#
# The build stage compiles dspark's kernels and gathers every wheel of requirements-runtime.txt
# (what serving and rollouts need: no build, test or benchmark tools, which requirements.txt adds
# for the project's virtualenv) from the package registry; the image installs them from that
# folder alone (--no-index), so nothing is downloaded when a pod starts. The Python minor version must be one that pytriton ships a
# backend stub for (3.8-3.13); 3.11 is the one the test suite runs on.
FROM python:3.11.7-slim-bookworm AS build
# Debian packages are not pinned: the mirror drops superseded versions, so a pin breaks the
# build; the base image's tag fixes the Debian release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends build-essential \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY requirements-runtime.txt setup.py pyproject.toml README.md ./
COPY cython_ext cython_ext
COPY dspark dspark
RUN pip wheel --no-cache-dir --wheel-dir /wheels -r requirements-runtime.txt \
    && pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

FROM python:3.11.7-slim-bookworm
# the Python backend stub links libstdc++, zlib and expat
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libstdc++6 zlib1g libexpat1 \
    && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /tmp/wheels
RUN pip install --no-cache-dir --no-index /tmp/wheels/*.whl \
    && rm -rf /tmp/wheels
# what dspark reads from its project folder at run time: the backends Triton loads, the entrypoint
ENV DSPARK_HOME=/opt/dspark
COPY backends /opt/dspark/backends
COPY deploy/k8s/entrypoint.py /opt/dspark/deploy/k8s/entrypoint.py
RUN groupadd --system --gid 10001 dspark \
    && useradd --system --uid 10001 --gid 10001 --create-home --home-dir /home/dspark dspark
USER 10001
WORKDIR /home/dspark
EXPOSE 8000 8001 8002
ENTRYPOINT ["python", "/opt/dspark/deploy/k8s/entrypoint.py"]

# The component image: `delayed-pubsub serve`, nothing else (no Spark: `pip install
# 'dapr-delayed-pubsub[spark]'` installs the analytics tools where they run).
#
#   docker build -t dapr-delayed-pubsub .
#   docker run -v sockets:/tmp/dapr-components-sockets dapr-delayed-pubsub
#
# BASE_IMAGE is any Debian-like image with python3 >= 3.11 and its venv module (the default,
# or Debian bookworm with python3-venv); both stages use it, so the venv's python is there.
ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
WORKDIR /src
# Dependencies first: their layer is reused while only the code changes.
COPY pyproject.toml README.md LICENSE* ./
# Behind a TLS-intercepting proxy, give pip your CA bundle as a build secret (never stored in
# the image): --secret id=pip-cert,src=/etc/ssl/certs/ca-certificates.crt
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
    && python3 -m venv /opt/delayed-pubsub \
    && /opt/delayed-pubsub/bin/python -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))' > /tmp/requirements.txt \
    && /opt/delayed-pubsub/bin/pip install --quiet -r /tmp/requirements.txt
COPY proto proto
COPY middleware middleware
COPY components components
# Not editable: the image carries the installed package, not this source tree.
RUN --mount=type=secret,id=pip-cert \
    if [ -s /run/secrets/pip-cert ]; then export PIP_CERT=/run/secrets/pip-cert; fi \
    && /opt/delayed-pubsub/bin/pip install --quiet --no-deps . \
    && /opt/delayed-pubsub/bin/pip uninstall --quiet --yes pip setuptools

FROM ${BASE_IMAGE}
# The component's own user. Its primary group is daprd's: the Dapr sidecar image runs as
# 65532:65532 (distroless "nonroot") unless the injector is configured otherwise, and the
# socket is created 0660 in the component's group, so daprd (and nobody else) can connect.
ARG UID=10001
ARG GID=65532
ARG SOCKETS_FOLDER=/tmp/dapr-components-sockets
RUN getent group "${GID}" >/dev/null || echo "dapr:x:${GID}:" >> /etc/group \
    && echo "delayed-pubsub:x:${UID}:${GID}:delayed-pubsub:/nonexistent:/usr/sbin/nologin" >> /etc/passwd \
    && mkdir -p "${SOCKETS_FOLDER}" \
    && chown "${UID}:${GID}" "${SOCKETS_FOLDER}" \
    && chmod 0770 "${SOCKETS_FOLDER}"
COPY --from=build /opt/delayed-pubsub /opt/delayed-pubsub
ENV PATH=/opt/delayed-pubsub/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    DAPR_COMPONENTS_SOCKETS_FOLDER=${SOCKETS_FOLDER}
USER ${UID}:${GID}
# daprd finds the component by its socket in this folder: share it with daprd's container.
VOLUME ["${SOCKETS_FOLDER}"]
# SIGTERM: serve drains its streams within --grace (default 5 s), removes its socket, exits 0.
STOPSIGNAL SIGTERM
ENTRYPOINT ["delayed-pubsub", "serve"]
CMD []

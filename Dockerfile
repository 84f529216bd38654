# The disagg-router image: the router and its runtime (FastAPI, uvicorn, httptools, ...) only, no vLLM.
#
#   docker build -t disagg/router .
#   docker run -p 8000:8000 -v $PWD/router.yaml:/etc/disagg-router/config.yaml disagg/router
#
# PYTHON_IMAGE is a build argument so the same file builds from a locally made base where no
# registry is reachable (deploy/docker/make-local-base.sh); any Debian-like image with python3 and
# its venv module works.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
RUN python3 -m venv /opt/router
COPY pyproject.toml constraints.txt /src/
COPY disagg_router /src/disagg_router
# A regular (non-editable) install: the runtime stage copies only the venv, not /src. The
# constraints are the versions CI tested together.
RUN /opt/router/bin/pip install --no-cache-dir -c /src/constraints.txt /src

FROM ${PYTHON_IMAGE}
COPY --from=build /opt/router /opt/router
ENV PATH=/opt/router/bin:${PATH} \
    PYTHONUNBUFFERED=1
# Unprivileged: the router needs no root.
USER 65534:65534
EXPOSE 8000
ENTRYPOINT ["disagg-router"]
CMD ["serve", "--config", "/etc/disagg-router/config.yaml", "--host", "0.0.0.0", "--port", "8000"]

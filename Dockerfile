# The image that `bamboo-launch k8s render` runs by default (--image bamboo-launch:0.1.0): the six bamboo
# packages installed the way `make setup` (scripts/setup.sh) installs them, except not editable.
#
#   docker build -t bamboo-launch:0.1.0 .            (from the repository root)
#
# The project's development machines have no container daemon, so this recipe has not been built there;
# each of its steps is one that `make setup` runs (packages/bamboo-launch/README.md, "Container image").
# packages/bamboo-launch/tests/test_k8s.py checks that its pins are setup.sh's and the packages'.
FROM python:3.11-slim

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    DS_ACCELERATOR=cpu \
    DS_BUILD_OPS=0

RUN python -m pip install --upgrade pip setuptools wheel

# torch first, the CPU build (what setup.sh installs: 2.13.0+cpu; bamboo-rc trains on CPU tensors over
# gloo). From PyPI's default index the same pin would pull the multi-GB CUDA build.
RUN python -m pip install --index-url https://download.pytorch.org/whl/cpu 'torch==2.13.0'

# deepspeed built for the CPU without build isolation (its setup.py imports torch); DS_BUILD_OPS=0
# compiles no ops.
RUN python -m pip install --no-build-isolation 'deepspeed==0.19.8'

# The six packages, dependencies first; their pins of torch and deepspeed are met by the two above.
WORKDIR /opt/bamboo
COPY packages/ packages/
RUN python -m pip install --no-build-isolation \
        packages/bamboo-schedule packages/bamboo-reconfig packages/bamboo-bench \
        packages/bamboo-membership packages/bamboo-rc packages/bamboo-launch \
    && rm -rf /opt/bamboo

WORKDIR /var/lib/bamboo
ENTRYPOINT ["bamboo-launch"]
CMD ["--help"]

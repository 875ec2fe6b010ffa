# CI's stand-in for the NGC PyTorch base image: Debian bookworm (debootstrap, imported by
# docker_engine.sh) with Python 3.11 and torch installed in the system Python.
# Build context: a directory holding the torch wheel.
FROM belief-lm-ci/rootfs:bookworm
COPY torch-*.whl /tmp/
# Debian marks its Python externally managed; like NGC's, this one is meant to be extended.
RUN python3 -m pip install --no-cache-dir --break-system-packages /tmp/torch-*.whl \
    && rm /tmp/torch-*.whl

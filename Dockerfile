# syntax=docker/dockerfile:1
# The specgate image: the `specgate` command that the operator runs, and the routers it creates
# (charts/specgate and deploy/operator.yaml run ghcr.io/specgate/specgate:<appVersion>). The
# engine pods run the other image, worker-image/.
#
#   docker build -t ghcr.io/specgate/specgate:<version in pyproject.toml> .
#
# Pin the base by digest for reproducible builds (docker buildx imagetools inspect python:3.11-slim).
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
# What the wheel is built from, and nothing else (tests/test_specgate_image.py builds the
# wheel from exactly these paths).
COPY pyproject.toml README.md LICENSE ./
COPY specgate/ specgate/
COPY operator/ operator/
COPY router/ router/
COPY sim/ sim/
RUN pip wheel --no-cache-dir --wheel-dir /wheels .

FROM ${PYTHON_IMAGE}
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir /wheels/*.whl && rm -rf /wheels \
    && python -m compileall -q "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
# The pods' securityContext runs as 65532 with a read-only root filesystem: nothing is written
# at run time (byte code is compiled above), and no home directory is needed. The user has a
# name: getpass.getuser() (kopf's identity) fails for a uid /etc/passwd does not list.
RUN groupadd --gid 65532 specgate \
    && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin specgate
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
USER 65532:65532
ENTRYPOINT ["specgate"]
CMD ["--help"]

# One image, two entry points: `promptlb-gateway` (the default) and `promptlb-sidecar`
# (docker run IMAGE promptlb-sidecar --model-url ...). The emulator comes along for local stacks.
FROM python:3.12.7-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY sidecar ./sidecar
COPY middleware ./middleware
COPY emulator ./emulator
COPY bench ./bench
RUN pip install ".[sidecar,middleware,emulator,redis]" && rm -rf /src

RUN useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin promptlb
USER 10001:10001
WORKDIR /home/promptlb

# 8080: the gateway; 9500: the sidecar.
EXPOSE 8080 9500

# Any 2xx from PROMPTLB_HEALTH_URL: the gateway's /v1/models by default; a sidecar sets its
# own /metrics (its /health is 503 while the model warms up, which is readiness, not life).
ENV PROMPTLB_HEALTH_URL=http://127.0.0.1:8080/v1/models
HEALTHCHECK --interval=15s --timeout=3s --start-period=20s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request as u; u.urlopen(os.environ['PROMPTLB_HEALTH_URL'], timeout=2)"]

CMD ["promptlb-gateway", "--config", "/etc/promptlb/promptlb.toml", "--host", "0.0.0.0", "--port", "8080"]

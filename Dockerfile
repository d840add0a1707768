# One image for server and worker. pip pulls the CUDA build of torch from PyPI, which GPU workers
# need; for a CPU-only image install a CPU torch wheel before tokentrail.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
# gcc builds the export's page encoder (server/export/fastpage_c/), then leaves the image
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && pip install --no-cache-dir -e . \
    && apt-get purge -y gcc libc6-dev && apt-get autoremove -y && rm -rf /var/lib/apt/lists/*
ENTRYPOINT ["tokentrail"]

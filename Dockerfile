# One image for server and worker. pip pulls the CUDA build of torch from PyPI, which GPU workers
# need; for a CPU-only image install a CPU torch wheel before tokentrail.
FROM python:3.11-slim
WORKDIR /app
COPY . /app
RUN pip install --no-cache-dir -e .
ENTRYPOINT ["tokentrail"]

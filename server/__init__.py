"""tokentrail server: FastAPI chat API, SQL storage, work queue, SSE token streams, worker hub."""

"""HTTP routes, one module per router (``chats``, ``auth``, ``admin``), with their request
dependencies (``deps``) and the SSE event source of a message (``sse``)."""

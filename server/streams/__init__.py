"""Per-message token streams that SSE readers follow: the contract (``protocol``) and its
in-process (``memory``) and Redis Streams (``redis``) backends."""

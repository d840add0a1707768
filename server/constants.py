"""Every Redis key prefix and stream name the server uses, in one place."""

PREFIX = "tt:"
# Work queue of one model: a stream with a consumer group (DESIGN D3).
WORK_STREAM = PREFIX + "work:{model}"
# Its retry lane: work lost after it was started or accepted, served first (uncapped).
WORK_RETRY_STREAM = PREFIX + "retry:{model}"
WORK_GROUP = "workers"
# Routing (server.workers.routing): one preferred worker's lane of a model, in the same group, and the
# model's lane owners (worker id -> "capacity:last claim ms").
WORK_LANE_STREAM = PREFIX + "lane:{model}:{worker}"
WORK_LANES = PREFIX + "lanes:{model}"
# Enqueue / dequeue counters of one model, for queue positions.
WORK_ENQ_COUNTER = PREFIX + "work:{model}:enq"
WORK_DEQ_COUNTER = PREFIX + "work:{model}:deq"
# Ticket (enqueue counter value) of one message, for its queue position.
WORK_TICKET = PREFIX + "ticket:{message_id}"
# Tokens of one message: a stream with explicit IDs 0-<end index> (DESIGN D4).
TOKEN_STREAM = PREFIX + "tokens:{message_id}"
# Where a new attempt restarted a lost token stream (readers that hold later tokens are reset).
TOKEN_RESTART = PREFIX + "tokens-restart:{message_id}"
# Models offered by connected workers: hash field per worker, refreshed by heartbeats.
WORKER_DIRECTORY = PREFIX + "workers"
MODELS_SEEN = PREFIX + "models_seen"  # model -> wall-clock time a worker last offered it
# A user's rate-limit state (GCRA theoretical arrival time, ms), shared by every server process.
RATE_LIMIT = PREFIX + "rate:{user_id}"
# Relayed tokenizer calls and cancels: one request list per server process, one reply list per call.
# Their prefix predates PREFIX; renaming it would break a rolling deploy (old and new processes must
# find each other's lists), so it stays until a release that restarts every replica.
RPC_REQUESTS = "tokentrail:rpc:{server_id}"
RPC_REPLY = "tokentrail:rpc-reply:{call_id}"
# The wake-up stream of one token-stream multiplexer (server/streams/redis_mux.py).
STREAM_WAKE = "tokentrail:stream-wake:{mux_id}"
# A server process's presence (server/workers/presence.py): refreshed with a short TTL while it lives.
SERVER_PRESENCE = PREFIX + "server:{server_id}"
# When this Redis first saw a presence (no TTL): absent or young, presence keys may just have been lost.
SERVER_EPOCH = PREFIX + "server-epoch"

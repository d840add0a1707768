"""The server side of the worker websocket (DESIGN D3, D5, D10): the hub that accepts workers and
dispatches work (``hub``), one worker's connection (``connection``), the checks on what workers send
(``ingest``), recovery of work that went wrong (``recovery``), tokenizer calls and cancellation across
server processes (``rpc``) over a Redis relay (``relay``)."""

"""The work queue of pending assistant messages and the directory of connected workers: the
contracts (``protocol``: ``WorkQueue``, ``WorkerDirectory``) and their in-process (``memory``) and
Redis (``redis``) backends. ("protocol" here means ``typing.Protocol``; the worker wire protocol is
``shared/protocol.py``.)"""

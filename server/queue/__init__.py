"""The work queue of pending assistant messages: the contract (``protocol``) and its in-process
(``memory``) and Redis (``redis``) backends."""

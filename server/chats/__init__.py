"""The conversation domain, below the routes and above storage: user-scoped chat trees
(``repository``), the fenced work transitions (``work_store``), fair-load admission (``admission``),
the models offered now (``catalog``). No routers, no requests or responses here."""

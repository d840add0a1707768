"""Translation between OpenAI's dialect and the chat trees (DESIGN D12, D14), for the routes in
``server/api/openai_chat.py`` and ``server/api/openai_completions.py``: requests onto stored
conversations (``conversations``), the request's model and sampling parameters (``params``), one
choice followed or collected (``choices``), response bodies and chunk pieces (``render``), and SSE
framing (``streaming``). No state of its own: the domain is ``server/chats``."""

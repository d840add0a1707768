"""HTTP routes, one module per router: parse the request, call the domain (``server/chats``,
``server/openai``), shape the answer.

- ``chats``: Open-Assistant's chat API (``/chats``, ``/configs``); ``sse``: its message events
- ``openai_chat``, ``openai_completions``: OpenAI's ``/v1/models``, ``/v1/chat/completions``,
  ``/v1/completions`` and vLLM's ``/inference/v1/generate``, with their presenters
- ``tokenizer``: vLLM's ``/tokenize`` and ``/detokenize``
- ``auth``, ``admin``: logins and tokens; users, keys and exports for administrators
- ``deps``: the request dependencies (app state, DB session, current user, repository)
"""

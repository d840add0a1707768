"""The Anthropic Messages API (``/v1/messages``) as a translation layer over the chat routes' pipeline:
requests become chat messages (``translate``), stored replies become Anthropic messages and stream
events (``render``, ``streaming``)."""

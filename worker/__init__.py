"""tokentrail worker: pulls work over a websocket, builds prompts token-exactly, runs an engine."""

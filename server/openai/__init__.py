"""The OpenAI-compatible API's machinery: conversations onto chat trees, following generations, response bodies."""

"""The OpenAI-compatible HTTP server and the request/response shaping it uses."""

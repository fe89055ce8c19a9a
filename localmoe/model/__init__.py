"""The model: ModelSpec, the shared transformer block and its ops, routing, expert providers."""

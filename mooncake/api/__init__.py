"""OpenAI-compatible HTTP API of the conductor."""

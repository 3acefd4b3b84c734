"""OpenAI-compatible HTTP server (FastAPI): `omnistage serve`."""

"""pi-serve: the OpenAI-compatible HTTP server over the batch-1 runtime (serve.py: the worker and its queue; app.py:
the FastAPI application; api.py: the API's rules and shapes; schemas.py: the OpenAPI page's models; cli.py: the
command)."""

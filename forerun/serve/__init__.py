"""`forerun serve`: an OpenAI-compatible HTTP server over one `forerun.Engine`.

- `protocol.py`: request and response bodies (pydantic), the OpenAI-style error body;
- `worker.py`: the one thread that owns the models, its queue and its step-level scheduler;
- `metrics.py`: the Prometheus registry of one server;
- `app.py`: the FastAPI routes; handlers validate, enqueue and stream, never touch a model.

Nothing outside this package imports it, except the CLI that starts it.
"""

"""asyncengine.api: the OpenAI-compatible HTTP / SSE / WebSocket server.

    from asyncengine.api import create_app
    app = create_app(AsyncLLMEngine(EngineConfig(model=...)), api_key="...")   # any ASGI server, or mount it

or from the shell: `asyncengine serve MODEL --port 8000` (see `asyncengine serve --help`).
"""

from asyncengine.api.app import create_app

__all__ = ["create_app"]

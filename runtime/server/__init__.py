"""``trtbuild serve``: an OpenAI-compatible HTTP server over the runtime (FastAPI + uvicorn)."""

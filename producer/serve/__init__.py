"""``producer serve``: the OpenAI-compatible gateway (FastAPI on uvicorn). Never imports mlx."""

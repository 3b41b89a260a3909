"""The OpenAI-compatible HTTP server (Starlette + uvicorn). Never touches MLX directly."""

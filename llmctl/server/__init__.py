"""The OpenAI-compatible HTTP server behind `llmctl serve`: FastAPI app, protocol models, metrics."""

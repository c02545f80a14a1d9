"""The API process: OpenAI-compatible HTTP in front of the engine process (see serve.py)."""

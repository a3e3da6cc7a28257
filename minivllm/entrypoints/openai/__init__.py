"""Chapter 09's server: OpenAI's HTTP API on the async engine (`api_server.py`)."""

"""How users reach the engine: the offline `LLM` API and the command line."""

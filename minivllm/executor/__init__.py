"""How the engine reaches its workers, in its own process or in others."""

"""Models: the registry, loading, placement, the compact forward, draft heads and feature heads."""

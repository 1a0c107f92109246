"""llamassp: measure speculative sampling (SSp) against regular sampling (RSp)."""

__version__ = "0.5.0"

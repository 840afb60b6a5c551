from rollout_engine.attention.base import AttentionBackend, create_backend

__all__ = ["AttentionBackend", "create_backend"]

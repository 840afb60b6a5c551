"""The engine's middle: building its parts, the one step loop (EngineCore)
and request creation."""

from rollout_engine.memory.manager import TAGS, MemoryManager
from rollout_engine.memory.saver import create_saver

__all__ = ["TAGS", "MemoryManager", "create_saver"]

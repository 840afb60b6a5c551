from rollout_engine.scheduler.config import SchedulerConfig
from rollout_engine.scheduler.scheduler import Scheduler

__all__ = ["Scheduler", "SchedulerConfig"]

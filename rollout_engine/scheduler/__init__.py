from rollout_engine.scheduler.scheduler import Scheduler, SchedulerConfig

__all__ = ["Scheduler", "SchedulerConfig"]

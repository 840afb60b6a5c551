from rollout_engine.distributed.comm import TPComm

__all__ = ["TPComm"]

"""Pipeline parallelism: the model's blocks cut into stages, GPipe and 1F1B schedules, DP x PP."""

from dtjob.trainer.parallel.pipeline.schedule import Action, schedule_actions, split_stages
from dtjob.trainer.parallel.pipeline.strategy import PipelineStrategy

__all__ = ["Action", "PipelineStrategy", "schedule_actions", "split_stages"]

"""Pipeline parallelism: the model cut into stages, GPipe and 1F1B schedules, DP x PP."""

from dtjob.trainer.parallel.pp.module import Pipeline, default_loss, pipeline
from dtjob.trainer.parallel.pp.schedule import Action, schedule_actions, split_stages
from dtjob.trainer.parallel.pp.split import auto_split

__all__ = ["Action", "Pipeline", "auto_split", "default_loss", "pipeline", "schedule_actions", "split_stages"]

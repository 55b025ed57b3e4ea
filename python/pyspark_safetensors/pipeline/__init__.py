"""The research pipeline: extraction in Spark, one SAE per hook point trained with torchrun,
LUTs for the linear layers they feed, held-out evaluation, one report
(``pyspark-safetensors pipeline``). Imports torch and pyspark only when run."""

from .errors import PipelineError
from .run import Pipeline, PipelineConfig

__all__ = ["Pipeline", "PipelineConfig", "PipelineError"]

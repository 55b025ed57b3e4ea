"""Optional metric sinks beside ``metrics.jsonl``: TensorBoard (torch's ``SummaryWriter``,
under ``out_dir/tensorboard``) and Weights & Biases, each used only when asked for in
``log_to`` and never required by the package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from ..format.errors import InvalidArgumentError

SINKS = ("tensorboard", "wandb")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb"}


def check_sinks(names: tuple[str, ...]) -> None:
    """Refuse an unknown sink, or one whose package is not installed, before training."""
    for name in names:
        if name not in SINKS:
            raise InvalidArgumentError(
                f"log_to: unknown sink {name!r}; choose from {', '.join(SINKS)}"
            )
        if importlib.util.find_spec(_PACKAGES[name]) is None:
            raise InvalidArgumentError(
                f"log_to includes {name!r} but the {_PACKAGES[name]} package is not installed "
                f"(pip install {_PACKAGES[name]})"
            )


class MetricSinks:
    """The sinks of one run (rank 0 only): ``log(metrics, step)`` then ``close()``."""

    def __init__(self, names: tuple[str, ...], out_dir: Path, config: dict, run_name: str = ""):
        check_sinks(names)
        self.writers = []
        if "tensorboard" in names:
            from torch.utils.tensorboard import SummaryWriter

            self.writers.append(
                ("tensorboard", SummaryWriter(log_dir=str(out_dir / "tensorboard")))
            )
        if "wandb" in names:
            import wandb

            run = wandb.init(project="pyspark-safetensors", name=run_name or out_dir.name,
                             dir=str(out_dir), config=config)  # fmt: skip
            self.writers.append(("wandb", run))

    def log(self, metrics: dict, step: int) -> None:
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}
        for kind, writer in self.writers:
            if kind == "tensorboard":
                for key, value in numbers.items():
                    writer.add_scalar(key, value, step)
            else:
                writer.log(numbers, step=step)

    def close(self) -> None:
        for kind, writer in self.writers:
            if kind == "tensorboard":
                writer.close()
            else:
                writer.finish()

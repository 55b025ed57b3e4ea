"""SAE quality against known features: SynthSAEBench's synthetic activation model
(``synthetic.py``: a model with Zipfian firing, hierarchies, low-rank correlations, in
SAELens' file layout), datasets of its samples with their true feature activations written
by Spark (``job.py``), and the ground-truth metrics (``groundtruth.py``: MCC, uniqueness,
per-latent precision / recall / F1, explained variance, L0, dead latents, shrinkage,
absorption), SAEBench's sparse probing (``probing.py``) and core figures (``core.py``:
reconstruction, shrinkage, sparsity, firing, the dictionary's layout), and sweeps of many
SAEs trained on a synthetic dataset and evaluated in one Spark job (``sweep.py``). Every
name loads its module (and torch) on first use."""

import importlib

_SUBMODULE = {
    **dict.fromkeys(
        (
            "ConstantFiring",
            "ExponentialMagnitude",
            "FoldedNormalMagnitude",
            "HierarchyConfig",
            "LinearFiring",
            "LinearMagnitude",
            "LowRankCorrelationConfig",
            "OrthogonalizationConfig",
            "RandomFiring",
            "SyntheticModel",
            "SyntheticModelConfig",
            "ZipfianFiring",
        ),
        "synthetic",
    ),
    **dict.fromkeys(
        ("SyntheticDataConfig", "synthetic_datasets", "write_synthetic_dataset"), "job"
    ),
    **dict.fromkeys(
        ("GroundTruthMetrics", "evaluate_ground_truth", "ground_truth_batches", "match_latents"),
        "groundtruth",
    ),
    **dict.fromkeys(
        (
            "ProbeTask",
            "factor_probe_tasks",
            "probe_tasks",
            "sparse_probing",
            "synthetic_probe_tasks",
        ),
        "probing",
    ),
    **dict.fromkeys(("CoreMetrics", "CoreSums", "core_metrics"), "core"),
    **dict.fromkeys(
        ("EvalSpec", "SweepConfig", "evaluate_in_loop", "evaluate_in_spark", "run_sweep"),
        "sweep",
    ),
}


def __getattr__(name: str):
    if name in _SUBMODULE:
        return getattr(importlib.import_module(f".{_SUBMODULE[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = sorted(_SUBMODULE)

"""``pyspark-safetensors`` (or ``python -m pyspark_safetensors.cli``): the command line.

Commands:
  pipeline  extraction -> one SAE per hook point (torchrun) -> LUTs -> held-out report
  extract   run a transformer over texts or images in Spark, write activation datasets
  train     train an SAE, transcoder or crosscoder (one process, or --nproc N: torchrun)
  lut       precompute lookup tables for linear layers from SAE checkpoints
  evaluate  a LUT directory against the exact layers on held-out corpus passages
  features  what each latent of an SAE, transcoder or crosscoder responds to, and a browser
  graphs    attribution graphs of prompts through a CLT or per-layer transcoders, in Spark
  export-graphs   a graph job's graphs as circuit-tracer's / Neuronpedia's graph JSON
  export-delphi   an SAE's latents on an extraction as delphi's latent cache
  export-neuronpedia  a feature browser's latents as Neuronpedia's export
  global-weights  virtual weights of a dictionary, expected attributions over graphs (Spark)
  sweep     SAEs of a grid on a synthetic dataset, evaluated in one Spark job; a leaderboard
  inspect   summarise a dataset, a saev dump, a Zarr store or a .safetensors file
  verify    check a dataset against its manifest, or a saev dump / Zarr store
  convert   convert between our datasets, saev dumps and Zarr stores
  bench     run the benchmarks (from a source checkout) into docs/BENCHMARKS.md

Every command takes ``--help`` (each option with its meaning and default). A mistake in
what you typed or gave (a ``PysparkSafetensorsError``: a bad option, file, dataset or
config value; a missing file) exits with code 2 and a one-line message; anything else is
a bug and keeps its traceback. ``--debug`` (before the command) shows the traceback of
any error.

Each command is a thin layer: its options are a config dataclass parsed by tyro, its work
a call into the stage's package.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect as inspect_module
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

from .format.errors import USER_ERRORS, PysparkSafetensorsError


class UsageError(PysparkSafetensorsError, ValueError):
    """A command line that cannot be run as typed."""


def _tyro():
    import tyro

    return tyro


def _parse(
    cls, argv: list[str], command: str, description: str, default=None, positionals: str = ""
):
    """``cls`` (a dataclass) from ``argv``: every field an option, its docstring the help.
    ``positionals`` (e.g. ``"SRC DST"``): the arguments taken before the options, named
    in the usage line."""
    tyro = _tyro()
    return tyro.cli(
        Annotated[cls, tyro.conf.OmitArgPrefixes],
        args=argv,
        default=default,
        prog=f"pyspark-safetensors {command}" + (f" {positionals}" if positionals else ""),
        description=inspect_module.cleandoc(description),
    )


@dataclass(frozen=True)
class StorageCommand:
    storage_option: tuple[str, ...] = ()
    """KEY=VALUE ... for URI inputs and outputs: endpoint_url, region, path_style,
    anonymous (default: the AWS_* environment variables)."""


def _parse_with_storage(cls, argv: list[str], command: str, description: str):
    """``_parse`` of ``cls`` and ``--storage-option``: ``(config, storage options)``."""
    omit = _tyro().conf.OmitArgPrefixes
    args_type = dataclasses.make_dataclass(
        f"{cls.__name__}Args",
        [("job", Annotated[StorageCommand, omit]), ("config", Annotated[cls, omit])],
        frozen=True,
    )
    args = _parse(args_type, argv, command, description)
    return args.config, _storage_options(args.job.storage_option)


def _split_config(argv: list[str]) -> tuple[str | None, list[str]]:
    """Take ``--config PATH`` (or ``--config=PATH``) out of ``argv``."""
    rest, path, it = [], None, iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise UsageError("--config needs a TOML file")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    return path, rest


# -- pipeline -------------------------------------------------------------------------------


def _default_pipeline_config() -> str | None:
    path = Path("conf/pipeline.toml")
    return str(path) if path.is_file() else None


def pipeline(argv: list[str]) -> int:
    """Extraction in Spark -> one TopK SAE per hook point (torchrun) -> LUTs -> held-out
    evaluation -> report.md and summary.json in --out. Stages are reused on a rerun.
    Options after --config override the file (default conf/pipeline.toml when present)."""
    from .pipeline import Pipeline, PipelineConfig

    path, rest = _split_config(argv)
    force = "--force" in rest
    rest = [a for a in rest if a != "--force"]
    config = _parse(
        PipelineConfig, rest, "pipeline",
        pipeline.__doc__ + " --force recomputes every stage.",
        default=PipelineConfig.load(path or _default_pipeline_config()),
    )  # fmt: skip
    Pipeline(config, force=force).run()
    return 0


# -- extract --------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExtractCommand:
    out: str
    """Output directory (published whole when the job succeeds), or a URI such as
    s3://bucket/acts (extraction.json is written last there)."""
    master: str = "local[*]"
    """Spark master."""
    overwrite: bool = False
    """Replace an existing output directory."""
    storage_option: tuple[str, ...] = ()
    """KEY=VALUE ... for a URI output: endpoint_url, region, path_style, anonymous
    (default: the AWS_* environment variables)."""


def _storage_options(items: tuple[str, ...]) -> dict[str, str]:
    """``--storage-option KEY=VALUE ...`` as the storage options of ``DatasetLocation``."""
    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise UsageError(f"--storage-option {item!r}: expected KEY=VALUE")
        options[key.strip()] = value
    return options


def extract(argv: list[str]) -> int:
    """Run a transformer over a corpus inside Spark and write its hook points'
    activations as safetensors datasets (see docs/extract.md). Texts (--corpus), or
    images (--images DIR|PREFIX|GLOB|TABLE with a vision model: --model DIR; every token
    of every image, unreadable files skipped or refused with --bad-images)."""
    from .extract import ExtractConfig, run_extraction
    from .spark.session import local_session

    tyro = _tyro()

    omit = tyro.conf.OmitArgPrefixes
    args_type = dataclasses.make_dataclass(  # both dataclasses' fields as one flat option list
        "ExtractArgs",
        [
            ("job", Annotated[ExtractCommand, omit]),
            (
                "config",
                Annotated[ExtractConfig, omit],
                dataclasses.field(default_factory=ExtractConfig),
            ),
        ],
        frozen=True,
    )
    args = _parse(args_type, argv, "extract", extract.__doc__)
    storage_options = _storage_options(args.job.storage_option)
    spark = local_session(args.job.master, quick_jit=True)  # the model runs in Python
    try:
        summary = run_extraction(
            spark, args.config, args.job.out, overwrite=args.job.overwrite,
            storage_options=storage_options,
        )  # fmt: skip
        print(summary)
    finally:
        spark.stop()
    return 0


# -- features -------------------------------------------------------------------------------


@dataclass(frozen=True)
class FeaturesCommand:
    master: str = "local[*]"
    """Spark master."""
    storage_option: tuple[str, ...] = ()
    """KEY=VALUE ... for a URI extraction or output: endpoint_url, region, path_style,
    anonymous (default: the AWS_* environment variables)."""


def features(argv: list[str]) -> int:
    """Encode every token of an extraction's hook point with an SAE or transcoder (a
    crosscoder: of its hook points' datasets, --datasets) inside Spark and
    write each latent's statistics, top-activating contexts and a static feature browser
    (--out/index.html; see docs/features.md)."""
    from .features import FeaturesConfig

    omit = _tyro().conf.OmitArgPrefixes
    args_type = dataclasses.make_dataclass(
        "FeaturesArgs",
        [("job", Annotated[FeaturesCommand, omit]),
         ("config", Annotated[FeaturesConfig, omit], dataclasses.field(default_factory=FeaturesConfig))],
        frozen=True,
    )  # fmt: skip
    args = _parse(args_type, argv, "features", features.__doc__)
    from .features import plan_features, run_features  # torch: after --help
    from .spark.session import local_session

    storage_options = _storage_options(args.job.storage_option)
    plan_features(args.config, storage_options)  # bad inputs stop here, before Spark starts
    spark = local_session(args.job.master)
    try:
        print(run_features(spark, args.config, storage_options=storage_options))
    finally:
        spark.stop()
    return 0


# -- graphs ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraphsCommand:
    master: str = "local[*]"
    """Spark master."""
    storage_option: tuple[str, ...] = ()
    """KEY=VALUE ... for a URI model, transcoder, prompts file or output: endpoint_url,
    region, path_style, anonymous (default: the AWS_* environment variables)."""


def graphs(argv: list[str]) -> int:
    """The attribution graph of every prompt (--prompts: a text file, one per line, or a
    parquet table's --column) in the model (--model) with a CLT or per-layer transcoders
    (--transcoders), made in Spark: nodes and pruned edges as parquet partitioned by
    prompt, each adjacency in a safetensors dataset, scores per prompt (see
    graphs/job.py). Each path may be a URI (s3://bucket/graphs, ...)."""
    from .dataset.location import DatasetLocation
    from .graphs.job import GraphsConfig

    omit = _tyro().conf.OmitArgPrefixes
    args_type = dataclasses.make_dataclass(
        "GraphsArgs",
        [("job", Annotated[GraphsCommand, omit]), ("config", Annotated[GraphsConfig, omit])],
        frozen=True,
    )
    args = _parse(args_type, argv, "graphs", graphs.__doc__)
    config = args.config
    storage_options = _storage_options(args.job.storage_option)
    for path in (config.model, *config.transcoders, config.prompts):
        where = DatasetLocation.of(path, storage_options=storage_options) if path else None
        if where is None or (where.is_local and not os.path.exists(where.root)):  # a URI: the job's
            raise FileNotFoundError(f"no such file or directory: {path!r}")
    from .graphs.job import run_graphs
    from .spark.session import local_session

    spark = local_session(args.job.master, quick_jit=True)  # the model runs in Python
    try:
        print(run_graphs(spark, config, storage_options=storage_options))
    finally:
        spark.stop()
    return 0


def export_graphs(argv: list[str]) -> int:
    """A graph job's graphs (--graphs) as circuit-tracer's / Neuronpedia's graph JSON in
    --out: {slug}.json per graph and graph-metadata.json (see graphs/export.py and
    docs/exports.md)."""
    from .graphs.export import GraphExportConfig

    config, options = _parse_with_storage(GraphExportConfig, argv, "export-graphs",
                                          export_graphs.__doc__)  # fmt: skip
    from .graphs.export import export_graphs as run

    print(run(config, storage_options=options))
    return 0


def export_delphi(argv: list[str]) -> int:
    """An SAE's or transcoder's (--sae; a CLT's layer: --clt-layer) latents on an
    extraction (--extraction) as delphi's latent cache in --out:
    {module}/{start}_{end}.safetensors and config.json (see features/delphi.py and
    docs/exports.md)."""
    from .features.delphi import DelphiConfig

    config, options = _parse_with_storage(DelphiConfig, argv, "export-delphi",
                                          export_delphi.__doc__)  # fmt: skip
    from .features.delphi import export_delphi as run

    print(run(config, storage_options=options))
    return 0


def export_neuronpedia(argv: list[str]) -> int:
    """A feature job's output (--features) as Neuronpedia's export of one source in --out:
    {model}/{layer}-{source set}/features/, activations/ and explanations/ as
    batch-{n}.jsonl.gz, and its model, release, source set and source rows (see
    features/neuronpedia.py and docs/exports.md)."""
    from .features.neuronpedia import NeuronpediaConfig

    config, options = _parse_with_storage(NeuronpediaConfig, argv, "export-neuronpedia",
                                          export_neuronpedia.__doc__)  # fmt: skip
    from .features.neuronpedia import export_neuronpedia as run

    print(run(config, storage_options=options))
    return 0


@dataclass(frozen=True)
class GlobalWeightsCommand:
    master: str = "local[*]"
    """Spark master (the expected attributions)."""
    storage_option: tuple[str, ...] = ()
    """KEY=VALUE ... for URI inputs and outputs: endpoint_url, region, path_style,
    anonymous (default: the AWS_* environment variables)."""


def global_weights(argv: list[str]) -> int:
    """Global weights into --out: the virtual weights of a CLT or per-layer transcoders
    (--model, --transcoders; default: the graph job's) and, with --graphs, the expected
    attributions over that graph job's graphs, aggregated in Spark; parquet partitioned by
    target layer (see graphs/global_weights.py and docs/exports.md)."""
    from .graphs.global_weights import GlobalWeightsConfig

    omit = _tyro().conf.OmitArgPrefixes
    args_type = dataclasses.make_dataclass(
        "GlobalWeightsArgs",
        [("job", Annotated[GlobalWeightsCommand, omit]),
         ("config", Annotated[GlobalWeightsConfig, omit])],
        frozen=True,
    )  # fmt: skip
    args = _parse(args_type, argv, "global-weights", global_weights.__doc__)
    from .graphs.global_weights import run_global_weights

    spark = None
    if args.config.graphs:
        from .spark.session import local_session

        spark = local_session(args.job.master, quick_jit=True)
    try:
        print(run_global_weights(spark, args.config,
                                 storage_options=_storage_options(args.job.storage_option)))  # fmt: skip
    finally:
        if spark is not None:
            spark.stop()
    return 0


# -- train ----------------------------------------------------------------------------------


def train(argv: list[str]) -> int:
    """Train an SAE (TopK, BatchTopK, JumpReLU, Matryoshka) on an activation dataset, a
    transcoder (--architecture transcoder or skip_transcoder) from --dataset to
    --target-dataset, or a crosscoder (--architecture crosscoder) over --datasets A B ....
    --config reads a TOML file (e.g. conf/sae.toml); options override it; --nproc N
    launches torchrun with N processes (set --data-parallel-size / --model-parallel-size
    to match)."""
    from .sae import SAEConfig

    path, rest = _split_config(argv)
    nproc = 1
    if "--nproc" in rest:
        i = rest.index("--nproc")
        try:
            nproc = int(rest[i + 1])
        except (IndexError, ValueError):
            raise UsageError("--nproc needs a number of processes") from None
        del rest[i : i + 2]
    if nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {nproc}")
    config = _parse(SAEConfig, rest, "train", train.__doc__, default=SAEConfig.load(path))
    from .sae.train import launch  # torch: after --help

    return launch(config, nproc)


# -- sweep ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class SweepCommand:
    config: str = "conf/sweep-synth.toml"
    """TOML file of the sweep (see conf/sweep-synth.toml and docs/evaluation.md)."""
    out: str = ""
    """Output directory (default: the config's `out`)."""
    master: str = "local[*]"
    """Spark master."""
    force: bool = False
    """Recompute every stage (data, SAEs, evaluation) instead of reusing it."""


def sweep(argv: list[str]) -> int:
    """A grid of SAEs (families x widths x k x seeds) trained on a synthetic dataset with
    known features, evaluated in one Spark job (a task per SAE: ground-truth figures and
    SAEBench's sparse probing), written as results.parquet, results.json, report.md (a
    leaderboard, mean +- sd over seeds) and Pareto plots. Data and SAEs are reused on a
    rerun."""
    args = _parse(SweepCommand, argv, "sweep", sweep.__doc__)
    from .evaluation.sweep import SweepConfig, run_sweep  # torch: after --help

    config = SweepConfig.load(args.config, **({"out": args.out} if args.out else {}))
    from .spark.session import local_session

    spark = local_session(args.master)
    try:
        summary = run_sweep(spark, config, force=args.force)
    finally:
        spark.stop()
    print(summary["report"])
    return 0


# -- lut ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LutCommand:
    sae: tuple[str, ...] = ()
    """LAYER[,LAYER...]=SAE_FILE, repeatable: the SAE each layer's LUT is built from."""
    out: str = ""
    """Output directory (default: MODEL_DIR/lut)."""
    dtype: str = "float16"
    """Storage dtype of the LUT files: float16 or bfloat16 (or an alias: F16, fp16, half, BF16)."""
    overwrite: bool = False
    """Replace an existing LUT directory."""


def lut(argv: list[str]) -> int:
    """Precompute lookup tables (docs/lut.md) for linear layers from SAE checkpoints, and
    for whole MLP blocks from transcoders (LAYER = the block, e.g. model.layers.0.mlp):
    pyspark-safetensors lut MODEL_DIR --sae LAYER[,LAYER...]=SAE_FILE [--sae ...]."""
    positional = [a for a in argv[:1] if not a.startswith("-")]
    args = _parse(LutCommand, argv[len(positional) :], "lut", lut.__doc__, positionals="MODEL_DIR")
    if not positional:
        raise UsageError(
            "lut needs MODEL_DIR first: pyspark-safetensors lut MODEL_DIR --sae LAYER=SAE_FILE"
        )
    if not args.sae:
        raise UsageError("lut needs at least one --sae LAYER[,LAYER...]=SAE_FILE")
    saes = {}
    for item in args.sae:
        layers, sep, path = item.rpartition("=")
        if not sep or not layers:
            raise UsageError(f"--sae {item!r} must be LAYER[,LAYER...]=SAE_FILE")
        saes.update(dict.fromkeys(layers.split(","), path))
    from .lut import precompute_lut  # torch: after the command line is checked

    meta = precompute_lut(
        positional[0], saes, out_dir=args.out or None, dtype=args.dtype, overwrite=args.overwrite
    )
    blocks = sum(entry.get("kind") == "mlp" for entry in meta["layers"].values())
    linear = len(meta["layers"]) - blocks
    # a block's tables are its transcoder's own: only linear layers' products are computed
    speed = f", {meta['timing']['flops_per_s'] / 1e9:.1f} GFLOP/s" if linear else ""
    whole = f" and {blocks} whole MLP block(s)" if blocks else ""
    print(f"{linear} linear layers{whole}{speed}")
    return 0


# -- evaluate -------------------------------------------------------------------------------


@dataclass(frozen=True)
class EvaluateCommand:
    model_dir: str = ""
    """Model directory of the LUT's layers; empty = the packaged all-MiniLM-L6-v2."""
    texts: int = 64
    """Held-out corpus passages to evaluate on."""
    skip: int = 600
    """Passages to skip first (those the SAEs were trained on)."""
    max_length: int = 128
    ks: tuple[int, ...] = ()
    """k values; empty = k/4, k/2, k, 2k of the LUT's k."""
    ms: tuple[int, ...] = (0, 32)
    """Compensation sizes m."""
    out: str = ""
    """Directory for evaluation.md and evaluation.png (none when empty)."""


def evaluate(argv: list[str]) -> int:
    """Evaluate a LUT directory on held-out corpus passages: every layer's relative L2
    error and cosine against the exact layer for several k and m, and the model's
    sentence embeddings with all LUT layers patched in:
    pyspark-safetensors evaluate LUT_DIR [options]."""
    positional = [a for a in argv[:1] if not a.startswith("-")]
    args = _parse(EvaluateCommand, argv[len(positional) :], "evaluate", evaluate.__doc__)
    if not positional:
        raise UsageError("evaluate needs LUT_DIR first: pyspark-safetensors evaluate LUT_DIR")
    from .lut import evaluate_on_passages  # torch: after the command line is checked

    result = evaluate_on_passages(
        positional[0], args.model_dir or None, texts=args.texts, skip=args.skip,
        max_length=args.max_length, ks=list(args.ks) or None, ms=args.ms,
        out_dir=args.out or None,
    )  # fmt: skip
    for r in result["layers"]:
        print(
            f"{r['layer']} k={r['k']} m={r['m']}: relative L2 {r['rel_l2']:.4f}, cosine {r['cosine']:.4f}"
        )
    for m, cos in result["embedding_cosine"].items():
        print(f"sentence embeddings, LUT layers vs original (m={m}): cosine {cos:.4f}")
    return 0


# -- inspect, verify, convert ----------------------------------------------------------------


@dataclass(frozen=True)
class PathCommand:
    limit: int = 20
    """Tensors to list for a single file (inspect)."""
    no_checksums: bool = False
    """Skip reading whole shards for their crc32c (verify)."""


def _one_path(argv: list[str], command: str, doc: str) -> tuple[str, PathCommand]:
    positional = [a for a in argv[:1] if not a.startswith("-")]
    args = _parse(PathCommand, argv[len(positional) :], command, doc, positionals="PATH")
    if not positional:
        raise UsageError(f"{command} needs a PATH: pyspark-safetensors {command} PATH")
    return positional[0], args


def inspect(argv: list[str]) -> int:
    """Summarise a dataset directory (local or a URI), a saev dump, a Zarr store or a
    single .safetensors file: pyspark-safetensors inspect PATH."""
    from .interop.inspect import describe

    path, args = _one_path(argv, "inspect", inspect.__doc__)
    print("\n".join(describe(path, limit=args.limit)))
    return 0


def verify(argv: list[str]) -> int:
    """Check a dataset against its manifest (sizes, headers, checksums), or a saev dump or
    a Zarr store against its metadata: pyspark-safetensors verify PATH."""
    from .interop.inspect import verify as verify_path

    path, args = _one_path(argv, "verify", verify.__doc__)
    print(verify_path(path, checksums=not args.no_checksums))
    return 0


@dataclass(frozen=True)
class ConvertCommand:
    to: Literal["safetensors", "zarr", "saev"]
    """Target format (for saev, DST is the dump_to directory)."""
    dtype: str | None = None
    """Storage dtype of the output (default: the source's)."""
    workers: int = 1
    """Parallel processes."""


def convert(argv: list[str]) -> int:
    """Convert between our datasets, saev dumps and Zarr activation stores (docs/interop.md):
    pyspark-safetensors convert SRC DST --to safetensors|zarr|saev. The source format is
    detected from SRC."""
    from .interop import convert as run_convert

    positional = [a for a in argv[:2] if not a.startswith("-")]
    args = _parse(
        ConvertCommand, argv[len(positional) :], "convert", convert.__doc__, positionals="SRC DST"
    )
    if len(positional) != 2:
        raise UsageError(
            "convert needs SRC and DST: pyspark-safetensors convert SRC DST --to FORMAT"
        )
    src, dst = positional
    out = run_convert(src, dst, to=args.to, dtype=args.dtype, workers=args.workers, progress=True)
    print(f"{src} -> {out}")
    return 0


# -- bench, demo -----------------------------------------------------------------------------


def bench(argv: list[str]) -> int:
    """Run benchmarks (all, or the names given) and update docs/BENCHMARKS.md; needs a
    source checkout (the benchmarks/ folder): pyspark-safetensors bench [NAME ...]."""
    if any(a in ("-h", "--help") for a in argv):
        print(bench.__doc__)
        return 0
    root = Path(__file__).resolve().parents[2]
    if not (root / "benchmarks" / "__main__.py").is_file():
        raise UsageError("the benchmarks ship with the source checkout; run this from a clone")
    return subprocess.run([sys.executable, "-m", "benchmarks", *argv], cwd=root).returncode


def demo(argv: list[str]) -> int:
    """The main job: the pipeline with the shipped config (conf/pipeline.toml)."""
    return pipeline(argv)


COMMANDS = {
    "pipeline": pipeline,
    "extract": extract,
    "train": train,
    "lut": lut,
    "evaluate": evaluate,
    "features": features,
    "graphs": graphs,
    "export-graphs": export_graphs,
    "export-delphi": export_delphi,
    "export-neuronpedia": export_neuronpedia,
    "global-weights": global_weights,
    "sweep": sweep,
    "inspect": inspect,
    "verify": verify,
    "convert": convert,
    "bench": bench,
    "demo": demo,
}


def _version() -> str:
    from . import __version__

    return __version__


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    if debug:  # entry points run in other processes (torchrun) show tracebacks too
        os.environ["PYSPARK_SAFETENSORS_DEBUG"] = "1"
    if argv[:1] in (["--version"], ["-V"]):
        print(f"pyspark-safetensors {_version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.split("\n\n", 1)[1].rstrip() if argv else __doc__.rstrip())
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        close = difflib.get_close_matches(name, COMMANDS, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        print(
            f"error: unknown command '{name}'{hint} (commands: {', '.join(COMMANDS)})",
            file=sys.stderr,
        )
        return 2
    started = time.perf_counter()
    try:
        rc = COMMANDS[name](rest)
    except SystemExit as e:  # the option parser's verdict (--help: 0, a mistake: 2)
        return e.code if isinstance(e.code, int) else 2
    except USER_ERRORS as e:
        if debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2
    if name in ("pipeline", "demo"):
        print(f"{name} finished in {time.perf_counter() - started:.0f} s")
    return rc


if __name__ == "__main__":
    sys.exit(main())

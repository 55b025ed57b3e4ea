"""``pyspark-safetensors`` (or ``python -m pyspark_safetensors.cli``): the command line.

Subcommands:
  pipeline   extraction -> one SAE per hook point (torchrun) -> LUTs -> held-out report
  demo       the main job end to end on an embedded local Spark
  extract    run a transformer over a corpus in Spark, write activation datasets
  train-sae  train a TopK SAE (same as python -m pyspark_safetensors.sae.train)
  lut        precompute lookup tables for linear layers from SAE checkpoints
  inspect    print a dataset's manifest summary or a file's tensors
  verify     check a dataset against its manifest, or a saev dump / Zarr store
  convert    convert between our datasets, saev dumps and Zarr stores
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _inspect(args) -> int:
    from .dataset import MANIFEST, DatasetLocation

    location = DatasetLocation.of(args.path)
    if location.has(MANIFEST):
        m = location.load_manifest()
        print(
            f"{location}: {m.mode} dataset, {m.total_samples:,} samples in {len(m.shards)} shards, {m.total_bytes / 1e6:,.1f} MB"
        )
        for name, col in m.schema.items():
            print(f"  {name}: {col.dtype} sample shape {list(col.sample_shape)}")
        for k, v in m.metadata.items():
            print(f"  metadata {k} = {v}")
        return 0
    parent, name = location.parent()
    header = parent.read_header(name)
    print(f"{location}: {len(header.tensors)} tensors, {header.data_bytes / 1e6:,.1f} MB of data")
    for t in header.tensors[: args.limit]:
        print(f"  {t.name}: {t.dtype} {list(t.shape)}")
    if len(header.tensors) > args.limit:
        print(f"  ... {len(header.tensors) - args.limit} more")
    return 0


def _verify(args) -> int:
    from .interop import detect_source

    kind = detect_source(args.path) if Path(args.path).is_dir() else "safetensors"
    if kind == "saev":
        from .interop.saev import verify_dump

        print(verify_dump(args.path))
    elif kind in ("zarr", "zarr-run"):
        from .interop.zarr import verify_store

        print(verify_store(args.path))
    else:
        from .dataset import verify_dataset

        m = verify_dataset(args.path, checksums=not args.no_checksums)
        print(f"{args.path}: whole ({len(m.shards)} shards, {m.total_samples:,} samples)")
    return 0


def _convert(args) -> int:
    from .interop import convert

    out = convert(
        args.src, args.dst, to=args.to, dtype=args.dtype, workers=args.workers, progress=True
    )
    print(f"{args.src} -> {out}")
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    start = time.time()
    run_demo(Path(args.out), texts=args.texts, epochs=args.epochs)
    print(f"demo finished in {time.time() - start:.1f}s; outputs in {args.out}")
    return 0


def _pipeline(args) -> int:
    from .pipeline import Pipeline, PipelineConfig

    overrides = {"out": args.out, "texts": args.texts, "epochs": args.epochs, "nproc": args.nproc}
    config = PipelineConfig.load(args.config, **overrides)
    Pipeline(config, force=args.force).run()
    return 0


def _train(args) -> int:
    from .sae.train import main as train_main

    return train_main(([f"--config={args.config}"] if args.config else []) + args.overrides)


def _extract(args) -> int:
    from .extract import ExtractConfig, run_extraction
    from .spark.session import local_session

    config = ExtractConfig(
        corpus=args.corpus,
        text_column=args.text_column,
        model_dir=args.model_dir,
        hooks=tuple(args.hook) if args.hook else ExtractConfig.hooks,
        max_length=args.max_length,
        dtype=args.dtype,
        max_texts=args.max_texts,
    )
    spark = local_session(args.master)
    try:
        print(run_extraction(spark, config, args.out, overwrite=args.overwrite))
    finally:
        spark.stop()
    return 0


def _lut(args) -> int:
    from .lut import precompute_lut

    saes = {}
    for item in args.sae:
        layers, sep, path = item.rpartition("=")
        if not sep:
            raise ValueError(f"--sae {item!r} must be LAYER[,LAYER...]=SAE_FILE")
        saes.update(dict.fromkeys(layers.split(","), path))
    meta = precompute_lut(
        args.model_dir, saes, out_dir=args.out, dtype=args.dtype, overwrite=args.overwrite
    )
    print(f"{len(meta['layers'])} layers, {meta['timing']['flops_per_s'] / 1e9:.1f} GFLOP/s")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="pyspark-safetensors", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("demo", help="run the main job end to end on an embedded local Spark")
    p.add_argument("--out", default="out/demo", help="output directory (default: out/demo)")
    p.add_argument("--texts", type=int, default=600, help="corpus passages (default: 600)")
    p.add_argument("--epochs", type=int, default=4, help="SAE training epochs (default: 4)")
    p.set_defaults(fn=_demo)
    p = sub.add_parser("pipeline", help="extract -> SAEs (torchrun) -> LUTs -> held-out report")
    p.add_argument("--config", default="conf/pipeline.toml", help="TOML config")
    p.add_argument("--out", help="output directory (default: the config's, runs/pipeline)")
    p.add_argument("--texts", type=int, help="training passages")
    p.add_argument("--epochs", type=int, help="passes over each hook point's tokens")
    p.add_argument("--nproc", type=int, help="torchrun processes per SAE")
    p.add_argument("--force", action="store_true", help="recompute every stage")
    p.set_defaults(fn=_pipeline)
    p = sub.add_parser("extract", help="run a transformer over a corpus in Spark")
    p.add_argument("out", help="output directory")
    p.add_argument("--corpus", default="demo", help="'demo', a text directory, or parquet/JSON")
    p.add_argument("--text-column", default="text")
    p.add_argument("--model-dir", default="", help="HF model dir (default: packaged MiniLM)")
    p.add_argument("--hook", action="append", help="module_glob:input|output (repeatable)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--dtype", default="F16", choices=["F16", "BF16", "F32"])
    p.add_argument("--max-texts", type=int, default=0)
    p.add_argument("--master", default="local[*]")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=_extract)
    p = sub.add_parser("train-sae", help="train a TopK SAE (config TOML + key=value)")
    p.add_argument("--config")
    p.add_argument("overrides", nargs="*")
    p.set_defaults(fn=_train)
    p = sub.add_parser("lut", help="precompute lookup tables from SAE checkpoints")
    p.add_argument("model_dir")
    p.add_argument("--sae", action="append", required=True, help="LAYER[,LAYER...]=SAE_FILE")
    p.add_argument("--out", help="output directory (default: MODEL_DIR/lut)")
    p.add_argument("--dtype", default="float16", choices=["float16", "bfloat16"])
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(fn=_lut)
    p = sub.add_parser("inspect", help="summarise a dataset directory or a .safetensors file")
    p.add_argument("path")
    p.add_argument("--limit", type=int, default=20, help="tensors to list for a file")
    p.set_defaults(fn=_inspect)
    p = sub.add_parser("verify", help="check a dataset against its manifest")
    p.add_argument("path")
    p.add_argument(
        "--no-checksums", action="store_true", help="skip reading whole shards for crc32c"
    )
    p.set_defaults(fn=_verify)
    p = sub.add_parser("convert", help="convert between datasets, saev dumps and Zarr stores")
    p.add_argument("src", help="a dataset, a saev dump (hash or dump_to dir), a Zarr store or run")
    p.add_argument("dst", help="output (for --to saev: the dump_to directory)")
    p.add_argument("--to", required=True, choices=["safetensors", "zarr", "saev"])
    p.add_argument("--dtype", help="storage dtype of the output (default: the source's)")
    p.add_argument("--workers", type=int, default=1, help="parallel processes (default: 1)")
    p.set_defaults(fn=_convert)
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, OSError) as e:
        if args.debug:
            raise
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

"""``pyspark-safetensors`` (or ``python -m pyspark_safetensors.cli``): the command line.

Subcommands:
  demo      the main job end to end on an embedded local Spark
  inspect   print a dataset's manifest summary or a file's tensors
  verify    check a dataset against its manifest (sizes, headers, checksums)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _inspect(args) -> int:
    from .dataset import MANIFEST, load_manifest
    from .format import read_header

    path = Path(args.path)
    if (path / MANIFEST).exists():
        m = load_manifest(path)
        print(
            f"{path}: {m.mode} dataset, {m.total_samples:,} samples in {len(m.shards)} shards, {m.total_bytes / 1e6:,.1f} MB"
        )
        for name, col in m.schema.items():
            print(f"  {name}: {col.dtype} sample shape {list(col.sample_shape)}")
        for k, v in m.metadata.items():
            print(f"  metadata {k} = {v}")
        return 0
    header = read_header(path)
    print(f"{path}: {len(header.tensors)} tensors, {header.data_bytes / 1e6:,.1f} MB of data")
    for t in header.tensors[: args.limit]:
        print(f"  {t.name}: {t.dtype} {list(t.shape)}")
    if len(header.tensors) > args.limit:
        print(f"  ... {len(header.tensors) - args.limit} more")
    return 0


def _verify(args) -> int:
    from .dataset import verify_dataset

    m = verify_dataset(args.path, checksums=not args.no_checksums)
    print(f"{args.path}: whole ({len(m.shards)} shards, {m.total_samples:,} samples)")
    return 0


def _demo(args) -> int:
    from .demo import run_demo

    start = time.time()
    run_demo(Path(args.out), texts=args.texts, epochs=args.epochs)
    print(f"demo finished in {time.time() - start:.1f}s; outputs in {args.out}")
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
    args = parser.parse_args(argv)
    try:
        return args.fn(args)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

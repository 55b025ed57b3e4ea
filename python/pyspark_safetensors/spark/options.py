"""Writer options: parsed once, case-insensitively, into a frozen, validated object."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..format import WRITABLE, DTypeNameError, canonical_dtype
from ..format.dtypes import ALIAS_EXAMPLES

TAIL_STRATEGIES = ("write", "drop", "pad")
DUPLICATE_STRATEGIES = ("fail", "lastWin")
CHECKSUMS = ("crc32c", "none")

MAX_ROWS = 2**31 - 1
"""Largest row count or dimension an option may give: Spark arrays, the Tensor Struct's
``shape: array<int>`` and Arrow's list offsets hold 32-bit signed counts."""

WRITER_OPTIONS = (
    "path", "batch_size", "name_col", "dtype", "columns", "shapes", "tail_strategy",
    "duplicatesStrategy", "kv_separator", "target_shard_size_mb", "generate_index",
    "metadata", "checksum",
)  # fmt: skip

_SURROGATE = re.compile("[\ud800-\udfff]")


class OptionError(ValueError):
    """An unknown option or a bad option value."""


def _bool(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name}={value!r}: expected true or false")


def _int(name: str, value: str, lo: int, hi: int = MAX_ROWS) -> int:
    """An integer option within ``lo..hi`` (by default what a 32-bit count holds)."""
    text = str(value).strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,30}", text):
        raise OptionError(f"option {name}={value!r}: expected an integer between {lo} and {hi}")
    n = int(text)
    if not lo <= n <= hi:
        raise OptionError(f"option {name}={n}: must be between {lo} and {hi}")
    return n


def unknown_option_error(unknown: list[str], known: tuple[str, ...]) -> OptionError:
    """An error naming the unknown options, the closest known ones and all of them."""
    by_lower = {k.lower(): k for k in known}
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name.lower(), list(by_lower), n=1, cutoff=0.6)
        if close:
            hints.append(f"{name} (did you mean {by_lower[close[0]]}?)")
        else:
            hints.append(name)
    return OptionError(
        f"unknown option(s) {', '.join(hints)}; valid options: {', '.join(sorted(known, key=str.lower))}"
    )


def _json(name: str, value: str, example: str):
    def refuse(constant):
        raise OptionError(f"option {name}: {constant} is not JSON; example: {example}")

    try:
        parsed = json.loads(value, parse_constant=refuse)
    except json.JSONDecodeError as e:
        raise OptionError(f"option {name}: not valid JSON ({e.msg}); example: {example}") from None
    except RecursionError:
        raise OptionError(f"option {name}: JSON nested too deeply; example: {example}") from None
    if _SURROGATE.search(json.dumps(parsed, ensure_ascii=False)):
        raise OptionError(f"option {name}: a string holds a lone UTF-16 surrogate (not UTF-8)")
    return parsed


def _choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    for c in choices:
        if value.lower() == c.lower():
            return c
    raise OptionError(f"option {name}={value!r}: valid values are {', '.join(choices)}")


@dataclass(frozen=True)
class WriterOptions:
    """The ``safetensors`` writer's options (see ``SafetensorsDataSource`` for the manual)."""

    path: str
    batch_size: int | None = None
    name_col: str | None = None
    dtype: str | None = None
    """One dtype for every numeric column (integer columns too), or None to keep each
    column's own."""
    column_dtypes: dict[str, str] = field(default_factory=dict)
    """Per-column dtypes (from a JSON ``dtype`` option); override ``dtype``."""
    columns: tuple[str, ...] | None = None
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tail_strategy: Literal["write", "drop", "pad"] = "write"
    duplicates_strategy: Literal["fail", "lastWin"] = "fail"
    kv_separator: str = "__"
    target_shard_size_mb: int = 300
    generate_index: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    checksum: Literal["crc32c", "none"] = "crc32c"

    @property
    def mode(self) -> Literal["batch", "kv"]:
        return "kv" if self.name_col is not None else "batch"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriterOptions:
        opts = {k.lower(): v for k, v in options.items()}
        known = {k.lower() for k in WRITER_OPTIONS}
        unknown = sorted(set(opts) - known)
        if unknown:
            raise unknown_option_error(
                [k for k in options if k.lower() in unknown],
                tuple(k for k in WRITER_OPTIONS if k != "path"),
            )
        if not opts.get("path"):
            raise OptionError(
                "no path: use .save(path) or .option('path', ...). saveAsTable, insertInto "
                "and INSERT INTO a catalog table hand no path to a Python data source: write "
                "the dataset with .save(path)"
            )
        if ("batch_size" in opts) == ("name_col" in opts):
            raise OptionError("set exactly one of batch_size (batch mode) or name_col (KV mode)")
        kw: dict = {"path": opts["path"]}
        if "batch_size" in opts:
            kw["batch_size"] = _int("batch_size", opts["batch_size"], 1)
        if "name_col" in opts:
            if not opts["name_col"]:
                raise OptionError("option name_col is empty")
            kw["name_col"] = opts["name_col"]
        if "dtype" in opts:
            raw = opts["dtype"].strip()
            if raw.startswith("{"):
                mapping = _json("dtype", raw, '{"activation": "F16", "token_pos": "I32"}')
                if not isinstance(mapping, dict):
                    raise OptionError("option dtype: a JSON object of column -> dtype")
                kw["column_dtypes"] = {str(c): _dtype(v) for c, v in mapping.items()}
            else:
                kw["dtype"] = _dtype(raw)
        if "columns" in opts:
            cols = tuple(c.strip() for c in opts["columns"].split(",") if c.strip())
            if not cols:
                raise OptionError(
                    "option columns is empty; give a comma-separated list of column names"
                )
            kw["columns"] = cols
        if "shapes" in opts:
            shapes = _json("shapes", opts["shapes"], '{"image": [3, 224, 224]}')
            if not isinstance(shapes, dict) or not all(
                isinstance(s, list)
                and all(
                    isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ROWS for d in s
                )
                for s in shapes.values()
            ):
                raise OptionError(
                    "option shapes: a JSON object of column -> list of ints in 0.."
                    f'{MAX_ROWS}, e.g. {{"image": [3, 224, 224]}}'
                )
            kw["shapes"] = {str(c): tuple(s) for c, s in shapes.items()}
        if "tail_strategy" in opts:
            kw["tail_strategy"] = _choice("tail_strategy", opts["tail_strategy"], TAIL_STRATEGIES)
        if "duplicatesstrategy" in opts:
            kw["duplicates_strategy"] = _choice(
                "duplicatesStrategy", opts["duplicatesstrategy"], DUPLICATE_STRATEGIES
            )
        if "kv_separator" in opts:
            if not opts["kv_separator"]:
                raise OptionError("option kv_separator is empty")
            kw["kv_separator"] = opts["kv_separator"]
        if "target_shard_size_mb" in opts:
            kw["target_shard_size_mb"] = _int(
                "target_shard_size_mb", opts["target_shard_size_mb"], 50, 1000
            )
        kw["generate_index"] = (
            _bool("generate_index", opts["generate_index"])
            if "generate_index" in opts
            else "name_col" in opts
        )
        if "metadata" in opts:
            md = _json(
                "metadata",
                opts["metadata"],
                '{"model": "all-MiniLM-L6-v2", "hook_point": "encoder.layer.0"}',
            )
            if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
                raise OptionError("option metadata: a JSON object of string keys to string values")
            kw["metadata"] = md
        if "checksum" in opts:
            kw["checksum"] = _choice("checksum", opts["checksum"], CHECKSUMS)
        return cls(**kw)

    def target_dtype(self, column: str, source: str) -> str:
        """The dtype a numeric column of dtype ``source`` is written as: its entry in the
        JSON ``dtype`` option, else the plain ``dtype`` option, else its own."""
        return self.column_dtypes.get(column) or self.dtype or source


def _dtype(value) -> str:
    try:
        return canonical_dtype(str(value), writable=True)
    except DTypeNameError as e:
        why = f"{e.read_only} can be read but not written; " if e.read_only else ""
        hint = f"; did you mean {e.closest}?" if e.closest else ""
        raise OptionError(
            f"option dtype={value!r}: {why}valid dtypes are {', '.join(WRITABLE)} (or their "
            f"usual names: {ALIAS_EXAMPLES}){hint}"
        ) from None

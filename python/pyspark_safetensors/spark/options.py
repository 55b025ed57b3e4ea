"""The source's options, writer's and reader's: parsed once, case-insensitively, into
frozen, validated objects, by one parser per option."""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from ..format import WRITABLE, DTypeNameError, canonical_dtype
from ..format.dtypes import ALIAS_EXAMPLES
from ..format.errors import PysparkSafetensorsError

TAIL_STRATEGIES = ("write", "drop", "pad")
DUPLICATE_STRATEGIES = ("fail", "lastWin")
CHECKSUMS = ("crc32c", "none")
VIEWS = ("rows", "kv", "tensors", "files", "index")
TENSOR_FORMATS = ("array", "struct")
IMPLEMENTATIONS = ("auto", "jvm", "python")
IMPLEMENTATION_CONF = "spark.pyspark_safetensors.implementation"
"""The session conf that picks the implementation of ``format("safetensors")`` where the JVM
shim's jar is on the classpath (the option ``implementation`` does it for one read or write)."""

MIN_SHARD_MB, DEFAULT_SHARD_MB, MAX_SHARD_MB = 50, 300, 1000
"""Bounds and default of ``target_shard_size_mb`` (KV shards): a task holds up to two
shards in memory, and smaller shards make more files than readers want to open."""

MAX_ROWS = 2**31 - 1
"""Largest row count or dimension an option may give: Spark arrays, the Tensor Struct's
``shape: array<int>`` and Arrow's list offsets hold 32-bit signed counts."""

_SURROGATE = re.compile("[\ud800-\udfff]")


class OptionError(PysparkSafetensorsError, ValueError):
    """An unknown option or a bad option value."""


# ------------------------------------------------------------------ value parsers


def parse_bool(name: str, value: str) -> bool:
    """A boolean option: true/false, 1/0, yes/no (any case)."""
    v = value.strip().lower()
    if v in ("true", "1", "yes"):
        return True
    if v in ("false", "0", "no"):
        return False
    raise OptionError(f"option {name}={value!r}: expected true or false")


def parse_int(name: str, value: str, lo: int, hi: int = MAX_ROWS) -> int:
    """An integer option within ``lo..hi`` (by default what a 32-bit count holds)."""
    text = str(value).strip()
    if not re.fullmatch(r"[+-]?[0-9]{1,30}", text):
        raise OptionError(f"option {name}={value!r}: expected an integer between {lo} and {hi}")
    n = int(text)
    if not lo <= n <= hi:
        raise OptionError(f"option {name}={n}: must be between {lo} and {hi}")
    return n


def parse_json(name: str, value: str, example: str):
    """A JSON option (no NaN/Infinity, no lone surrogates); errors show ``example``."""

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


def parse_choice(name: str, value: str, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (any case), spelled as the choice is."""
    for c in choices:
        if value.lower() == c.lower():
            return c
    raise OptionError(f"option {name}={value!r}: valid values are {', '.join(choices)}")


def parse_dtype(value) -> str:
    """A writable dtype named any usual way, as its canonical name."""
    try:
        return canonical_dtype(str(value), writable=True)
    except DTypeNameError as e:
        why = f"{e.read_only} can be read but not written; " if e.read_only else ""
        hint = f"; did you mean {e.closest}?" if e.closest else ""
        raise OptionError(
            f"option dtype={value!r}: {why}valid dtypes are {', '.join(WRITABLE)} (or their "
            f"usual names: {ALIAS_EXAMPLES}){hint}"
        ) from None


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


# ------------------------------------------------------------------ writer options


def _non_empty(name: str, value: str) -> str:
    if not value:
        raise OptionError(f"option {name} is empty")
    return value


def _kv_separator_option(value: str) -> dict:
    if not value:
        raise OptionError(
            "option kv_separator is empty: with no separator a tensor name cannot be split "
            "back into key and column; use one that no key contains, such as '__' (the "
            "default), '/' or '::'"
        )
    return {"kv_separator": value}


def _implementation_option(value: str) -> dict:
    # The JVM source answers auto and jvm where its jar is on the classpath, and hands
    # python to this source; reaching here with jvm means the jar is absent.
    if parse_choice("implementation", value, IMPLEMENTATIONS) == "jvm":
        raise OptionError(
            "option implementation=jvm, but the JVM implementation is not on this session's "
            "classpath: start the session with pyspark_safetensors.with_shim(builder), or put "
            "the shim jar on spark.jars (a cluster library on Databricks)"
        )
    return {}


def _dtype_option(value: str) -> dict:
    raw = value.strip()
    if not raw.startswith("{"):
        return {"dtype": parse_dtype(raw)}
    mapping = parse_json("dtype", raw, '{"activation": "F16", "token_pos": "I32"}')
    if not isinstance(mapping, dict):
        raise OptionError("option dtype: a JSON object of column -> dtype")
    return {"column_dtypes": {str(c): parse_dtype(v) for c, v in mapping.items()}}


def _columns_option(value: str) -> dict:
    cols = tuple(c.strip() for c in value.split(",") if c.strip())
    if not cols:
        raise OptionError("option columns is empty; give a comma-separated list of column names")
    return {"columns": cols}


def _is_dimension(d) -> bool:
    return isinstance(d, int) and not isinstance(d, bool) and 0 <= d <= MAX_ROWS


def _shapes_option(value: str) -> dict:
    shapes = parse_json("shapes", value, '{"image": [3, 224, 224]}')
    if not isinstance(shapes, dict) or not all(
        isinstance(s, list) and all(_is_dimension(d) for d in s) for s in shapes.values()
    ):
        raise OptionError(
            "option shapes: a JSON object of column -> list of ints in 0.."
            f'{MAX_ROWS}, e.g. {{"image": [3, 224, 224]}}'
        )
    return {"shapes": {str(c): tuple(s) for c, s in shapes.items()}}


def _metadata_option(value: str) -> dict:
    md = parse_json(
        "metadata", value, '{"model": "all-MiniLM-L6-v2", "hook_point": "encoder.layer.0"}'
    )
    if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
        raise OptionError("option metadata: a JSON object of string keys to string values")
    return {"metadata": md}


_WRITER_PARSERS: dict[str, Callable[[str], dict]] = {
    "batch_size": lambda v: {"batch_size": parse_int("batch_size", v, 1)},
    "name_col": lambda v: {"name_col": _non_empty("name_col", v)},
    "dtype": _dtype_option,
    "columns": _columns_option,
    "shapes": _shapes_option,
    "tail_strategy": lambda v: {"tail_strategy": parse_choice("tail_strategy", v, TAIL_STRATEGIES)},
    "duplicatesStrategy": lambda v: {
        "duplicates_strategy": parse_choice("duplicatesStrategy", v, DUPLICATE_STRATEGIES)
    },
    "kv_separator": _kv_separator_option,
    "target_shard_size_mb": lambda v: {
        "target_shard_size_mb": parse_int("target_shard_size_mb", v, MIN_SHARD_MB, MAX_SHARD_MB)
    },
    "generate_index": lambda v: {"generate_index": parse_bool("generate_index", v)},
    "metadata": _metadata_option,
    "checksum": lambda v: {"checksum": parse_choice("checksum", v, CHECKSUMS)},
    "keep_previous_generation": lambda v: {
        "keep_previous_generation": parse_bool("keep_previous_generation", v)
    },
    "implementation": _implementation_option,
}
"""One parser per writer option (besides ``path``), in the order they are checked: each
returns the ``WriterOptions`` fields it sets."""

WRITER_OPTIONS = ("path", *_WRITER_PARSERS)


def _lowered(options: Mapping[str, str], known: tuple[str, ...], shown: tuple[str, ...]):
    """The options by lower-case name; unknown names are refused with the closest."""
    opts = {k.lower(): v for k, v in options.items()}
    unknown = sorted(set(opts) - {k.lower() for k in known})
    if unknown:
        raise unknown_option_error([k for k in options if k.lower() in unknown], shown)
    return opts


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
    target_shard_size_mb: int = DEFAULT_SHARD_MB
    generate_index: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    checksum: Literal["crc32c", "none"] = "crc32c"
    keep_previous_generation: bool = False
    """Overwrite only: keep the replaced generation's files until the next commit, so
    readers that opened the old manifest can finish (default: deleted at commit)."""

    @property
    def mode(self) -> Literal["batch", "kv"]:
        return "kv" if self.name_col is not None else "batch"

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> WriterOptions:
        opts = _lowered(options, WRITER_OPTIONS, tuple(_WRITER_PARSERS))
        if not opts.get("path"):
            raise OptionError(
                "no path: use .save(path) or .option('path', ...). saveAsTable, insertInto "
                "and INSERT INTO a catalog table hand no path to a Python data source (a Spark "
                "limitation): write the dataset with .save(path), or load the shim jar "
                "(with_shim) so that the JVM source, which takes a table's location, answers"
            )
        if ("batch_size" in opts) == ("name_col" in opts):
            raise OptionError("set exactly one of batch_size (batch mode) or name_col (KV mode)")
        # The index is on by default in KV mode, where keys are looked up one by one.
        kw: dict = {"path": opts["path"], "generate_index": "name_col" in opts}
        for name, parse_value in _WRITER_PARSERS.items():
            if name.lower() in opts:
                kw.update(parse_value(opts[name.lower()]))
        return cls(**kw)

    def target_dtype(self, column: str, source: str) -> str:
        """The dtype a numeric column of dtype ``source`` is written as: its entry in the
        JSON ``dtype`` option, else the plain ``dtype`` option, else its own."""
        return self.column_dtypes.get(column) or self.dtype or source


# ------------------------------------------------------------------ reader options


def _paths_option(value: str) -> list[str]:
    """What Spark passes for ``load([p1, p2])`` (a JSON list of paths), or a
    comma-separated list given as ``option("paths", "a,b")``."""
    try:
        listed = json.loads(value)
    except json.JSONDecodeError:
        listed = [p.strip() for p in value.split(",") if p.strip()]
    if isinstance(listed, str):
        listed = [listed]
    if not listed or not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise OptionError(
            f"option paths={value!r}: expected a JSON list or a comma-separated list of paths"
        )
    return listed


_READER_PARSERS: dict[str, Callable[[str], dict]] = {
    "view": lambda v: {"view": parse_choice("view", v, VIEWS)},
    "tensor_format": lambda v: {"tensor_format": parse_choice("tensor_format", v, TENSOR_FORMATS)},
    "include_data": lambda v: {"include_data": parse_bool("include_data", v)},
    "rows_per_partition": lambda v: {"rows_per_partition": parse_int("rows_per_partition", v, 1)},
    # Spark's own file sources and the Scala connector take it; a safetensors header always
    # holds the schema, so it only picks the files view for plain files (see default_view).
    "inferSchema": lambda v: {"infer_schema": parse_bool("inferSchema", v)},
    "implementation": _implementation_option,
    # a stream's admission control, named as Spark's file source and ReadLimits name it
    "maxFilesPerTrigger": lambda v: {
        "max_files_per_trigger": parse_int("maxFilesPerTrigger", v, 1)
    },
    "maxRowsPerTrigger": lambda v: {"max_rows_per_trigger": parse_int("maxRowsPerTrigger", v, 1)},
}
"""One parser per read option (besides the paths)."""

READER_OPTIONS = ("path", "paths", *_READER_PARSERS)


@dataclass(frozen=True)
class ReaderOptions:
    """The ``safetensors`` reader's options (see ``SafetensorsDataSource`` for the manual)."""

    path: str
    """The first (or only) path, as given."""
    view: str | None = None
    tensor_format: str = "array"
    include_data: bool = True
    rows_per_partition: int | None = None
    """Rows view: one partition per range of this many rows of each shard; None packs
    shards into partitions of about ``reader.PARTITION_BYTES``."""
    paths: tuple[str, ...] = ()
    """Every path given (``load([p1, p2])``); read as one DataFrame."""
    infer_schema: bool = False
    """``inferSchema=true``: plain files default to the ``files`` view."""
    max_files_per_trigger: int | None = None
    """A stream's micro-batch reads at most this many shards (Spark 4.2+)."""
    max_rows_per_trigger: int | None = None
    """A stream's micro-batch reads at most this many rows, in whole shards: at least one
    (Spark 4.2+)."""

    def __post_init__(self):
        if not self.paths:
            object.__setattr__(self, "paths", (self.path,))
        if self.max_files_per_trigger and self.max_rows_per_trigger:
            raise OptionError("give one of maxFilesPerTrigger and maxRowsPerTrigger")

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> ReaderOptions:
        opts = _lowered(options, READER_OPTIONS, tuple(_READER_PARSERS))
        paths = [opts["path"]] if opts.get("path") else []
        if "paths" in opts:
            paths += _paths_option(opts["paths"])
        if not paths:
            raise OptionError(
                "no path: use .load(path) or .load([path, ...]). A catalog table (saveAsTable, "
                "CREATE TABLE ... USING safetensors) hands no path to a Python data source (a "
                "Spark limitation): read the dataset with spark.read.format('safetensors')"
                ".load(path), CREATE TEMPORARY VIEW ... USING safetensors OPTIONS (path '...'), "
                "or load the shim jar (with_shim) so that the JVM source answers"
            )
        kw: dict = {"path": paths[0], "paths": tuple(paths)}
        for name, parse_value in _READER_PARSERS.items():
            if name.lower() in opts:
                kw.update(parse_value(opts[name.lower()]))
        return cls(**kw)

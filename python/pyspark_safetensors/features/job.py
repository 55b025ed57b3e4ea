"""The feature job: every token of a hook point's activation dataset encoded by an SAE
inside Spark tasks, per-latent state merged by Spark, examples decoded with the model's
tokenizer, two parquet tables and the browser published whole.

1. encode (``mapInArrow``): each task folds its tokens into a ``LatentState`` (bounded
   memory) and emits it as rows: statistics per (latent, bin), top-N candidates, sample
   candidates; written under the staging directory;
2. merge (Spark): sums and maxima per cell, ``row_number`` windows keep the global top-N
   per latent and the bottom-R priorities per (latent, bin); the driver receives
   O(latents x (N + bins x R)) rows, never activations;
3. contexts (Spark): the example tokens' samples only are read again and encoded, their
   texts tokenized, and each example's window of +-``context`` tokens assembled with the
   latent's activation on every token.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from .config import FeaturesConfig, FeaturesError
from .merge import examples_table, latents_table
from .state import LatentState, histogram_edges, priority, split_ids, token_ids

CANDIDATES_SCHEMA = (
    "kind byte, latent int, cell long, value float, token long, priority long, "
    "count long, total double"
)
STAT, MAXIMUM, TOKENS, TOP, SAMPLE = 0, 1, 2, 3, 4
CODES_SCHEMA = "sample_id long, window int, token_pos int, latents array<int>, acts array<float>"
TOKENS_SCHEMA = "sample_id long, window int, pos int, token string"


@dataclass(frozen=True)
class FeaturesPlan:
    """What the job reads, checked before any task runs."""

    dataset: str
    hook: str
    width: int
    n_latents: int
    k: int
    sae: str
    model_dir: str
    max_length: int
    long_texts: str
    extraction: str


def plan_features(config: FeaturesConfig) -> FeaturesPlan:
    """Check the inputs (one-line errors naming the file or setting) and resolve the hook,
    the widths and the tokenizer."""
    from ..sae.ecosystem import read_sae

    root = Path(config.extraction)
    doc_path = root / "extraction.json"
    if not doc_path.is_file():
        raise FeaturesError(f"{doc_path}: no extraction here (run `pyspark-safetensors extract`)")
    doc = json.loads(doc_path.read_text())
    for table in ("samples.parquet", "texts.jsonl"):
        if not (root / table).is_file():
            raise FeaturesError(f"{root / table}: missing token table; re-run the extraction")
    tensors, info = read_sae(config.sae)
    n, d = tensors["encoder_weight"].shape
    hook = config.hook or (info.get("metadata") or {}).get("hook_point", "")
    hooks = doc["hooks"]
    if not hook and len(hooks) == 1:
        hook = next(iter(hooks))
    if hook not in hooks:
        raise FeaturesError(
            f"hook point {hook!r} is not in {doc_path} (it has {sorted(hooks)}); set --hook"
        )
    width = int(hooks[hook]["width"])
    if width != d:
        raise FeaturesError(
            f"{config.sae}: SAE input width {d} differs from {hook}'s width {width} in {root}"
        )
    if info["k"] is None:
        raise FeaturesError(f"{config.sae}: the SAE records no k (a TopK SAE is needed)")
    model_dir = doc.get("model_dir") or ""
    if not Path(model_dir, "config.json").is_file():
        from ..extract import resolve_model

        model_dir = str(resolve_model(doc["config"].get("model", "")).path)
    cfg = doc["config"]
    return FeaturesPlan(
        dataset=str(root / hooks[hook]["dataset"]), hook=hook, width=d, n_latents=n, k=int(info["k"]),
        sae=str(config.sae), model_dir=model_dir, max_length=int(cfg["max_length"]),
        long_texts=cfg.get("long_texts", "window"), extraction=str(root),
    )  # fmt: skip


_SAES: dict = {}


def load_encoder(sae: str, device: str, threads: int = 0):
    """The SAE as a ``TopKSAE`` on ``device``, once per Python worker."""
    from ..sae.ecosystem import load_sae_model

    if threads:
        torch.set_num_threads(threads)
    key = (sae, device)
    if key not in _SAES:
        _SAES.clear()
        _SAES[key] = load_sae_model(sae, device=device)
    return _SAES[key]


def pick_device(config: FeaturesConfig) -> str:
    return config.device or ("cuda" if torch.cuda.is_available() else "cpu")


def activations_of(batch: pa.RecordBatch, width: int) -> np.ndarray:
    """The batch's ``activation`` rows (``array<float>``, as the reader gives them: F16 and
    BF16 widened) as float32 ``[rows, width]``; the values lie back to back."""
    column = batch.column("activation")
    if len(column) == 0:
        return np.zeros((0, width), np.float32)
    values = column.flatten().to_numpy(zero_copy_only=False).astype(np.float32, copy=False)
    x = values.reshape(len(column), -1)
    if x.shape[1] != width:
        raise FeaturesError(f"activation rows have width {x.shape[1]}, the SAE {width}")
    return x if x.flags.writeable else x.copy()  # torch wants writable memory


def scalars_of(batch: pa.RecordBatch, name: str) -> np.ndarray:
    """A per-token column (``sample_id``, ``window``, ``token_pos``) as int64."""
    return batch.column(name).to_numpy(zero_copy_only=False).astype(np.int64)


def encode_batches(batches, sae, width: int, batch_tokens: int, device: str):
    """``(values, indices, ids)`` per chunk of ``batch_tokens`` tokens of Arrow batches."""
    for big in batches:
        for offset in range(0, big.num_rows, batch_tokens):
            b = big.slice(offset, batch_tokens)
            x = torch.from_numpy(activations_of(b, width)).to(device)
            ids = token_ids(*(scalars_of(b, c) for c in ("sample_id", "window", "token_pos")))
            with torch.inference_mode():
                values, indices = sae.encode(x)
            yield values, indices, torch.from_numpy(ids)


def new_state(plan: FeaturesPlan, config: FeaturesConfig) -> LatentState:
    edges = torch.from_numpy(histogram_edges(config.hist_bins, config.hist_min, config.hist_max))
    return LatentState(plan.n_latents, config.top_n, config.samples_per_band, edges, config.seed)


def _encode_fn(plan: FeaturesPlan, config: FeaturesConfig):
    """The task: its tokens folded into one state, emitted as candidate rows."""

    def run(batches):
        device = pick_device(config)
        sae = load_encoder(plan.sae, device, config.threads)
        state = new_state(plan, config)
        for values, indices, ids in encode_batches(batches, sae, plan.width,
                                                    config.batch_tokens, device):  # fmt: skip
            state.update(values, indices, ids)
        yield from state_rows(state)

    return run


def state_rows(state: LatentState):
    """A state as ``CANDIDATES_SCHEMA`` batches."""

    def batch(kind, latent, cell=None, value=None, token=None, prio=None, count=None, total=None):
        m = len(latent)
        zeros = np.zeros(m, np.int64)
        return pa.RecordBatch.from_pydict({
            "kind": pa.array(np.full(m, kind, np.int8)),
            "latent": pa.array(np.asarray(latent, np.int32)),
            "cell": pa.array(zeros if cell is None else np.asarray(cell, np.int64)),
            "value": pa.array(np.zeros(m, np.float32) if value is None else np.asarray(value, np.float32)),
            "token": pa.array(zeros if token is None else np.asarray(token, np.int64)),
            "priority": pa.array(zeros if prio is None else np.asarray(prio, np.int64)),
            "count": pa.array(zeros if count is None else np.asarray(count, np.int64)),
            "total": pa.array(np.zeros(m) if total is None else np.asarray(total, np.float64)),
        })  # fmt: skip

    cells = torch.nonzero(state.counts).flatten()
    yield batch(STAT, (cells // state.bins).numpy(), cells.numpy(), count=state.counts[cells].numpy(),
                total=state.sums[cells].numpy())  # fmt: skip
    fired = torch.nonzero(state.maxima).flatten()
    yield batch(MAXIMUM, fired.numpy(), value=state.maxima[fired].numpy())
    yield batch(TOKENS, [-1], count=[state.tokens])
    t, s = state.top, state.samples
    yield batch(TOP, t["latent"].numpy(), value=t["value"].numpy(), token=t["id"].numpy())
    prio = priority(s["id"], s["latent"], state.seed)
    yield batch(SAMPLE, s["latent"].numpy(), s["cell"].numpy(), s["value"].numpy(), s["id"].numpy(),
                prio.numpy())  # fmt: skip


def _codes_fn(plan: FeaturesPlan, config: FeaturesConfig):
    """The task of the contexts pass: each token's sparse code (latents, activations)."""

    def run(batches):
        device = pick_device(config)
        sae = load_encoder(plan.sae, device, config.threads)
        for big in batches:
            for values, indices, ids in encode_batches([big], sae, plan.width,
                                                       config.batch_tokens, device):  # fmt: skip
                sample_id, window, pos = split_ids(ids.numpy())
                rows, k = values.shape
                offsets = pa.array(np.arange(rows + 1, dtype=np.int32) * k)
                yield pa.RecordBatch.from_pydict({
                    "sample_id": pa.array(sample_id),
                    "window": pa.array(window.astype(np.int32)),
                    "token_pos": pa.array(pos.astype(np.int32)),
                    "latents": pa.ListArray.from_arrays(offsets, pa.array(
                        indices.cpu().numpy().astype(np.int32).ravel())),
                    "acts": pa.ListArray.from_arrays(offsets, pa.array(
                        values.float().cpu().numpy().ravel())),
                })  # fmt: skip

    return run


def _tokenize_fn(plan: FeaturesPlan):
    """Texts -> one row per token of each model input, as the extraction tokenized them
    (same tokenizer, ``max_length`` and windows)."""

    def run(batches):
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(plan.model_dir, local_files_only=True)
        for batch in batches:
            enc = tokenizer(
                batch.column("text").to_pylist(), truncation=True, max_length=plan.max_length,
                return_overflowing_tokens=plan.long_texts == "window", padding=False,
            )  # fmt: skip
            ids = batch.column("sample_id").to_pylist()
            mapping = enc.get("overflow_to_sample_mapping", list(range(len(ids))))
            seen: dict[int, int] = {}
            cols: dict[str, list] = {"sample_id": [], "window": [], "pos": [], "token": []}
            for r, input_ids in enumerate(enc["input_ids"]):
                window = seen.get(mapping[r], 0)
                seen[mapping[r]] = window + 1
                tokens = tokenizer.convert_ids_to_tokens(input_ids)
                cols["sample_id"] += [ids[mapping[r]]] * len(tokens)
                cols["window"] += [window] * len(tokens)
                cols["pos"] += list(range(len(tokens)))
                cols["token"] += tokens
            types = {"sample_id": pa.int64(), "window": pa.int32(), "pos": pa.int32(),
                     "token": pa.string()}  # fmt: skip
            yield pa.RecordBatch.from_pydict({c: pa.array(v, types[c]) for c, v in cols.items()})

    return run


@dataclass
class FeaturesSummary:
    out: Path
    hook: str
    tokens: int
    latents: int
    dead: int
    dense: int
    encode_seconds: float
    seconds: float

    @property
    def tokens_per_s(self) -> float:
        """Tokens per second of the encode-and-merge pass (the statistics and top-N)."""
        return self.tokens / max(self.encode_seconds, 1e-9)

    def __str__(self) -> str:
        return (
            f"{self.out}: {self.latents:,} latents of {self.hook} over {self.tokens:,} tokens "
            f"({self.dead} dead, {self.dense} dense), {self.tokens_per_s:,.0f} tokens/s, "
            f"{self.seconds:.1f} s in all"
        )


def run_features(spark, config: FeaturesConfig) -> FeaturesSummary:
    """Compute every latent's statistics and examples over the whole dataset and publish
    ``latents.parquet``, ``contexts.parquet`` and the browser at ``config.out`` (built
    under a staging name: a failed job leaves nothing there)."""
    from ..dataset.publish import publishing
    from .page import write_browser

    plan = plan_features(config)
    if not config.out:
        raise FeaturesError("out is empty: give an output directory (--out)")
    out = Path(config.out)
    if out.exists() and not config.overwrite:
        raise FeaturesError(f"{out} exists; pass overwrite=True (--overwrite) to replace it")
    started = time.perf_counter()
    with publishing(out) as tmp:
        tokens = spark.read.format("safetensors").load(plan.dataset)
        tokens = tokens.select("activation", "sample_id", "window", "token_pos")
        candidates = tmp / "candidates"  # a name Spark lists (it skips "_" and ".")
        tokens.mapInArrow(_encode_fn(plan, config), CANDIDATES_SCHEMA).write.parquet(
            str(candidates)
        )
        state = merged_state(spark.read.parquet(str(candidates)), plan, config)
        encode_seconds = time.perf_counter() - started
        latents = latents_table(state, config)
        spark.createDataFrame(latents).coalesce(1).write.parquet(str(tmp / "latents.parquet"))
        contexts = contexts_frame(spark, tokens, examples_table(state, config), plan, config)
        contexts.coalesce(1).write.parquet(str(tmp / "contexts.parquet"))
        shutil.rmtree(candidates)
        write_browser(
            tmp, title=f"{plan.hook} · {Path(plan.sae).name}", tokens=state.tokens, config=config
        )
    dead = int(np.sum(latents.column("dead").to_numpy(zero_copy_only=False)))
    dense = int(np.sum(latents.column("dense").to_numpy(zero_copy_only=False)))
    return FeaturesSummary(out, plan.hook, state.tokens, plan.n_latents, dead, dense,
                           encode_seconds, time.perf_counter() - started)  # fmt: skip


def merged_state(candidates, plan: FeaturesPlan, config: FeaturesConfig) -> LatentState:
    """The tasks' states merged by Spark (sums, maxima, ``row_number`` windows), as one
    ``LatentState`` on the driver: O(latents x (N + bins x R)) rows cross, no activations."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    stats = (
        candidates.filter(F.col("kind").isin(STAT, MAXIMUM, TOKENS))
        .groupBy("kind", "latent", "cell")
        .agg(F.sum("count").alias("count"), F.sum("total").alias("total"), F.max("value"))
        .toArrow()
    )
    by_value = Window.partitionBy("latent").orderBy(F.desc("value"), F.asc("token"))
    top = (
        candidates.filter(F.col("kind") == TOP)
        .withColumn("r", F.row_number().over(by_value))
        .filter(F.col("r") <= config.top_n)
        .select("latent", "value", "token")
        .toArrow()
    )
    by_priority = Window.partitionBy("cell").orderBy("priority", "token")
    samples = (
        candidates.filter(F.col("kind") == SAMPLE)
        .withColumn("r", F.row_number().over(by_priority))
        .filter(F.col("r") <= config.samples_per_band)
        .select("latent", "cell", "value", "token")
        .toArrow()
    )
    state = new_state(plan, config)
    kind = stats.column("kind").to_numpy()
    col = {name: stats.column(name).to_numpy() for name in ("latent", "cell", "count", "total")}
    value = stats.column("max(value)").to_numpy()
    stat, maximum = kind == STAT, kind == MAXIMUM
    state.counts[torch.from_numpy(col["cell"][stat])] = torch.from_numpy(col["count"][stat])
    state.sums[torch.from_numpy(col["cell"][stat])] = torch.from_numpy(col["total"][stat])
    state.maxima[torch.from_numpy(col["latent"][maximum].astype(np.int64))] = torch.from_numpy(
        value[maximum].astype(np.float32)
    )
    state.tokens = int(col["count"][kind == TOKENS].sum())
    state.top = _entries_of(top)
    cells = samples.column("cell").to_numpy().astype(np.int64)
    entries = {**_entries_of(samples), "cell": torch.from_numpy(cells)}
    state.samples = {**entries, "prio": priority(entries["id"], entries["latent"], state.seed)}
    return state


def _entries_of(table: pa.Table) -> dict:
    return {
        "latent": torch.from_numpy(table.column("latent").to_numpy().astype(np.int64)),
        "value": torch.from_numpy(table.column("value").to_numpy().astype(np.float32)),
        "id": torch.from_numpy(table.column("token").to_numpy().astype(np.int64)),
    }


def contexts_frame(spark, tokens, examples: pa.Table, plan: FeaturesPlan, config: FeaturesConfig):
    """One row per example: its window of +-``context`` tokens (token text, the latent's
    activation on each, the example token's index ``center``), assembled by joins over
    the example samples only."""
    from pyspark.sql import functions as F

    ex = spark.createDataFrame(examples)
    needed = ex.select("sample_id", "window").distinct()
    codes = tokens.join(F.broadcast(needed), ["sample_id", "window"], "left_semi").mapInArrow(
        _codes_fn(plan, config), CODES_SCHEMA
    )
    texts = (
        spark.read.schema("sample_id long, key string, source string, text string")
        .json(str(Path(plan.extraction) / "texts.jsonl"))
        .join(F.broadcast(needed.select("sample_id").distinct()), "sample_id", "left_semi")
        .mapInArrow(_tokenize_fn(plan), TOKENS_SCHEMA)
    )
    k = config.context
    positions = ex.withColumn(
        "pos", F.explode(F.sequence(F.col("token_pos") - k, F.col("token_pos") + k))
    )
    joined = positions.join(texts, ["sample_id", "window", "pos"]).join(
        codes.withColumnRenamed("token_pos", "pos"), ["sample_id", "window", "pos"], "left"
    )
    act = F.coalesce(
        F.try_element_at(F.map_from_arrays("latents", "acts"), F.col("latent")), F.lit(0.0)
    )
    keys = ["latent", "kind", "rank", "value", "sample_id", "window", "token_pos"]
    grouped = (
        joined.withColumn("act", act.cast("float"))
        .groupBy(*keys)
        .agg(F.sort_array(F.collect_list(F.struct("pos", "token", "act"))).alias("w"))
    )
    return grouped.select(
        *keys,
        F.col("w.token").alias("tokens"),
        F.col("w.act").alias("acts"),
        (F.array_position(F.col("w.pos"), F.col("token_pos")) - 1).cast("int").alias("center"),
    ).orderBy("latent", "kind", "rank")

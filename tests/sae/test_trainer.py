"""The trainer on one process: config handling, a real short run, exact resume, the
checkpoint format, and the errors a user meets."""

import json

import numpy as np
import pytest
import safetensors.numpy
import torch

from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.sae import CheckpointError, SAEConfig, load_sae
from pyspark_safetensors.sae.checkpoint import SAE_TENSORS, latest_checkpoint
from pyspark_safetensors.sae.train import NonFiniteLoss, Trainer, main


def _config(dataset, out, **kw):
    base = dict(dataset=str(dataset), n_latents=192, k=6, batch_size=256, tokens=256 * 24,
                warmup_steps=3, lr=2e-3, dead_tokens=2048, out_dir=str(out), log_every=4,
                checkpoints=2, progress=False)  # fmt: skip
    return SAEConfig(**{**base, **kw})


# --- config ---------------------------------------------------------------------------


def test_config_from_toml_with_overrides(tmp_path, repo_root):
    cfg = SAEConfig.load(
        repo_root / "conf" / "sae.toml", ["k=8", "lr=1e-3", "adam_betas=[0.8, 0.9]"]
    )
    assert cfg.k == 8 and cfg.lr == 1e-3 and cfg.adam_betas == (0.8, 0.9)
    assert cfg.expansion_factor == 16
    with pytest.raises(ValueError, match="unknown config key"):
        SAEConfig.load(None, ["kk=3"])
    with pytest.raises(ValueError, match="k must be an integer"):
        SAEConfig.load(None, ["k=abc"])
    with pytest.raises(ValueError, match="not key=value"):
        SAEConfig.load(None, ["k"])
    with pytest.raises(ValueError, match="exceeds n_latents"):
        SAEConfig(d=8, n_latents=16, k=17)
    with pytest.raises(ValueError, match="not divisible by model_parallel_size"):
        SAEConfig(d=8, n_latents=15, k=2, model_parallel_size=2)
    with pytest.raises(ValueError, match="does not split"):
        SAEConfig(batch_size=101, data_parallel_size=2)
    with pytest.raises(ValueError, match="b_dec_init"):
        SAEConfig(b_dec_init="median")


def test_config_hash_names_the_training_not_the_outputs():
    a = SAEConfig(d=8, k=4)
    assert (
        a.config_hash()
        == SAEConfig(d=8, k=4, out_dir="elsewhere", model_parallel_size=1).config_hash()
    )
    assert a.config_hash() != SAEConfig(d=8, k=5).config_hash()
    assert len(a.config_hash()) == 64


# --- training -------------------------------------------------------------------------


def test_short_run_learns_the_dictionary(tmp_path, activations):
    trainer = Trainer(_config(activations, tmp_path / "run", tokens=256 * 120, lr=5e-3))
    assert trainer.config.d == 32 and trainer.config.hook_point == "synthetic.layer"
    metrics = trainer.fit()
    assert metrics["fvu"] < 0.35
    assert metrics["l0"] == pytest.approx(6, abs=0.5)
    assert metrics["dead_fraction"] < 0.2
    run = tmp_path / "run"
    for name in (
        "sae.safetensors",
        "config.json",
        "metrics.jsonl",
        "training.png",
        "latent_frequency.png",
    ):
        assert (run / name).is_file(), name
    # the reference library reads the checkpoint; names and shapes are the LUT spec's
    tensors = safetensors.numpy.load_file(run / "sae.safetensors")
    assert {k: v.shape for k, v in tensors.items()} == {
        "encoder_weight": (192, 32), "encoder_bias": (192,),
        "decoder_weight": (192, 32), "decoder_bias": (32,),
    }  # fmt: skip
    _, meta = load_sae(run / "sae.safetensors")
    assert meta["config"]["k"] == 6 and meta["hook_point"] == "synthetic.layer"
    assert meta["metrics"]["fvu"] == pytest.approx(metrics["fvu"])
    np.testing.assert_allclose(np.linalg.norm(tensors["decoder_weight"], axis=1), 1, atol=1e-5)
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == list(range(4, 121, 4))


def test_resume_continues_exactly(tmp_path, activations):
    full = Trainer(_config(activations, tmp_path / "a"))
    full.fit()
    want = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    # stop early with a checkpoint, then resume in a fresh trainer
    part = Trainer(_config(activations, tmp_path / "b"))
    ckpts = sorted(part.checkpoint_steps())
    assert ckpts, "the config should produce an intermediate checkpoint"
    part.total_steps = ckpts[0]
    part.fit()
    resumed = Trainer(_config(activations, tmp_path / "b", resume="auto"))
    resumed.load(tmp_path / "b" / "checkpoints" / f"step-{ckpts[0]:08d}")
    assert resumed.step == ckpts[0]
    resumed.fit()
    got = [json.loads(x) for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    after = [g for g in got if g["step"] > ckpts[0]]
    expect = [w for w in want if w["step"] > ckpts[0]]
    assert [g["step"] for g in after] == [w["step"] for w in expect]
    for g, w in zip(after, expect, strict=True):
        assert g["fvu"] == w["fvu"] and g["aux_loss"] == w["aux_loss"]
    a, _ = load_sae(tmp_path / "a" / "sae.safetensors")
    b, _ = load_sae(tmp_path / "b" / "sae.safetensors")
    for name in SAE_TENSORS:
        assert torch.equal(a[name], b[name]), name


def test_cli_entry_point_trains_and_resumes(tmp_path, activations, capsys):
    args = [f"dataset={activations}", "n_latents=64", "k=4", "batch_size=512", "tokens=4096",
            f"out_dir={tmp_path}", "progress=false", "checkpoints=1"]  # fmt: skip
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 8
    assert latest_checkpoint(tmp_path).name == "step-00000008"
    assert main([*args, "resume=auto"]) == 0  # already complete: nothing left to do
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 8


# --- bad input ------------------------------------------------------------------------


def test_width_and_column_mismatches_are_named(tmp_path, activations):
    with pytest.raises(ValueError, match="d=16 but the dataset's 'activation' has width 32"):
        Trainer(_config(activations, tmp_path, d=16))
    with pytest.raises(ValueError, match="no column 'resid'"):
        Trainer(_config(activations, tmp_path, column="resid"))
    with pytest.raises(ValueError, match=r"samples of shape \[\]"):
        Trainer(_config(activations, tmp_path, column="sample_id"))
    with pytest.raises(ValueError, match="fewer than one global batch"):
        Trainer(_config(activations, tmp_path, batch_size=1 << 20))
    with pytest.raises(ValueError, match="model=1, the config asks for 1 x 2"):
        Trainer(_config(activations, tmp_path, model_parallel_size=2))


def test_non_finite_loss_stops_with_a_checkpoint_of_the_last_good_state(tmp_path):
    x = np.random.default_rng(0).standard_normal((1024, 8)).astype(np.float32)
    x[700] = np.inf
    write_batch_dataset(tmp_path / "bad", {"activation": x}, rows_per_shard=1024)
    trainer = Trainer(SAEConfig(dataset=str(tmp_path / "bad"), n_latents=32, k=2, batch_size=128,
                                out_dir=str(tmp_path / "run"), progress=False, b_dec_init="zeros"))  # fmt: skip
    with pytest.raises(NonFiniteLoss, match=r"non-finite loss at step \d+.*last good state saved"):
        trainer.fit()
    ckpt = latest_checkpoint(tmp_path / "run")
    tensors, meta = load_sae(ckpt / "sae.safetensors")
    assert all(torch.isfinite(t).all() for t in tensors.values())
    assert int(meta["step"]) == trainer.step


def test_missing_or_foreign_checkpoints_are_refused(tmp_path, activations):
    trainer = Trainer(_config(activations, tmp_path / "run", tokens=256 * 4, checkpoints=0))
    trainer.fit()
    ckpt = latest_checkpoint(tmp_path / "run")
    other = Trainer(_config(activations, tmp_path / "x", k=5))
    with pytest.raises(CheckpointError, match=r"different training config.*'k': \(6, 5\)"):
        other.load(ckpt)
    (ckpt / "trainer_state.pt").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"unreadable trainer state"):
        Trainer(_config(activations, tmp_path / "run")).load(ckpt)
    (ckpt / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing \['trainer_state.pt'\]"):
        Trainer(_config(activations, tmp_path / "run")).load(ckpt)
    with pytest.raises(CheckpointError, match="no checkpoint"):
        main([f"dataset={activations}", f"out_dir={tmp_path / 'empty'}", "resume=auto", "k=4"])


def test_command_line_train_sae(tmp_path, activations, repo_root):
    from pyspark_safetensors.cli import main as cli

    args = ["train-sae", "--config", str(repo_root / "conf" / "sae.toml"), f"dataset={activations}",
            "expansion_factor=2", "batch_size=1024", "tokens=4096", f"out_dir={tmp_path}",
            "progress=false"]  # fmt: skip
    assert cli(args) == 0
    assert (tmp_path / "sae.safetensors").is_file()
    assert cli([*args[:3], "k=0"]) == 2  # a bad value is a clean error, not a traceback

"""The trainer on one process: config handling, a real short run, exact resume, the
checkpoint format, and the errors a user meets."""

import json
import shutil
from dataclasses import replace

import numpy as np
import pytest
import safetensors.numpy
import torch

from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.sae import CheckpointError, SAEConfig, load_sae
from pyspark_safetensors.sae.checkpoint import SAE_TENSORS, file_sha256, latest_checkpoint
from pyspark_safetensors.sae.train import NonFiniteLoss, Trainer, launch, main


def _config(dataset, out, **kw):
    base = dict(dataset=str(dataset), n_latents=192, k=6, batch_size=256, tokens=256 * 24,
                warmup_steps=3, lr=2e-3, dead_tokens=2048, out_dir=str(out), log_every=4,
                checkpoints=2, progress=False, plots=False)  # fmt: skip
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


@pytest.mark.trained
def test_short_run_learns_the_dictionary(tmp_path, activations, seed, figure):
    """Spread over seeds 0-4 on the pinned CPU path, identical at 1 and 2 threads
    (tests/margins.py): FVU 0.220-0.234 (< 0.35, margin +33 %), dead 0-1.0 % (< 20 %)."""
    trainer = Trainer(_config(activations, tmp_path / "run", tokens=256 * 120, lr=5e-3, plots=True,
                              seed=seed))  # fmt: skip
    assert trainer.config.d == 32 and trainer.config.hook_point == "synthetic.layer"
    metrics = trainer.fit()
    figure("fvu", metrics["fvu"], below=0.35)
    assert metrics["l0"] == pytest.approx(6, abs=0.5)
    figure("dead_fraction", metrics["dead_fraction"], below=0.2)
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
    assert not list((tmp_path / "a").glob("*.png"))  # plots=False
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
            f"out_dir={tmp_path}", "progress=false", "plots=false", "checkpoints=1"]  # fmt: skip
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 8
    assert latest_checkpoint(tmp_path).name == "step-00000008"
    assert main([*args, "resume=auto"]) == 0  # already complete: nothing left to do
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["step"] == 8


def test_several_runs_in_one_launch_equal_each_run_alone(tmp_path, activations, capsys):
    # one after another in the same process (what the pipeline launches once for all its
    # hook points): nothing of a run leaks into the next
    small = dict(n_latents=64, tokens=256 * 12, warmup_steps=1, checkpoints=0)
    a = _config(activations, tmp_path / "a", **small, k=4)
    b = _config(activations, tmp_path / "b", **small, k=8, architecture="batchtopk", seed=3)
    assert launch(replace(b, out_dir=str(tmp_path / "b-alone"))) == 0  # before any other run
    capsys.readouterr()
    assert launch([a, b]) == 0
    summaries = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["step"], round(r["l0"])) for r in summaries] == [(12, 4), (12, 8)]
    together, alone = (
        load_sae(tmp_path / "b" / "sae.safetensors")[0],
        load_sae(tmp_path / "b-alone" / "sae.safetensors")[0],
    )
    assert together.keys() == alone.keys()
    for name in together:
        torch.testing.assert_close(together[name], alone[name], rtol=0, atol=0, msg=name)
    assert (tmp_path / "a" / "sae.safetensors").is_file()

    # refused before the first run starts: one out_dir for two runs, two meshes
    for runs, message in [
        ([a, replace(b, out_dir=a.out_dir)], "need an out_dir each"),
        ([replace(a, out_dir=str(tmp_path / "c")), replace(b, model_parallel_size=2)],
         "share one mesh"),
    ]:  # fmt: skip
        assert launch(runs) == 2
        assert message in capsys.readouterr().err
    assert not (tmp_path / "c").exists()
    # a mesh other than the processes launched: refused before torchrun starts
    assert launch([replace(a, out_dir=str(tmp_path / "c"), model_parallel_size=4)], 2) == 2
    assert "= 4, but 2 processes are launched" in capsys.readouterr().err
    assert not (tmp_path / "c").exists()

    # a mistake only a run's start finds (its width): the runs before it are finished
    wrong = replace(b, out_dir=str(tmp_path / "e"), d=16)
    assert launch([replace(a, out_dir=str(tmp_path / "d")), wrong]) == 2
    assert "d=16 but the dataset's 'activation' has width 32" in capsys.readouterr().err
    assert (tmp_path / "d" / "sae.safetensors").is_file()
    assert not (tmp_path / "e" / "sae.safetensors").exists()


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
    with pytest.raises(CheckpointError, match=r"trainer_state.pt does not match its recorded"):
        Trainer(_config(activations, tmp_path / "run", resume="auto")).load(ckpt)
    sums = json.loads((ckpt / "checksums.json").read_text())
    sums["trainer_state.pt"] = file_sha256(ckpt / "trainer_state.pt")  # garbage, recorded
    (ckpt / "checksums.json").write_text(json.dumps(sums))
    with pytest.raises(CheckpointError, match=r"unreadable trainer state"):
        Trainer(_config(activations, tmp_path / "run", resume="auto")).load(ckpt)
    (ckpt / "trainer_state.pt").unlink()
    with pytest.raises(CheckpointError, match=r"missing \['trainer_state.pt'\]"):
        Trainer(_config(activations, tmp_path / "run", resume="auto")).load(ckpt)
    # the entry point reports a user's mistake in one line, exit code 2
    assert (
        main([f"dataset={activations}", f"out_dir={tmp_path / 'empty'}", "resume=auto", "k=4"]) == 2
    )


def test_command_line_train_sae(tmp_path, activations, repo_root):
    from pyspark_safetensors.cli import main as cli

    args = ["train", "--config", str(repo_root / "conf" / "sae.toml"), "--dataset", str(activations),
            "--expansion-factor", "2", "--batch-size", "1024", "--tokens", "4096",
            "--out-dir", str(tmp_path), "--no-progress", "--no-plots"]  # fmt: skip
    assert cli(args) == 0
    assert (tmp_path / "sae.safetensors").is_file() and not list(tmp_path.glob("*.png"))
    assert cli([*args, "--k", "0"]) == 2  # a bad value is a clean error, not a traceback
    assert cli(args) == 2  # a second run into the same directory is refused ...
    assert cli([*args, "--overwrite"]) == 0  # ... unless asked to start over


def test_a_run_directory_holds_one_run(tmp_path, activations, capsys):
    Trainer(_config(activations, tmp_path)).fit()
    with pytest.raises(ValueError, match="already holds a training run"):
        Trainer(_config(activations, tmp_path))

    def steps():
        return [
            json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()
        ]

    first = steps()
    Trainer(_config(activations, tmp_path, overwrite=True)).fit()
    assert steps() == first  # replaced, not appended


def test_resume_may_extend_the_run(tmp_path, activations):
    Trainer(_config(activations, tmp_path)).fit()
    longer = Trainer(_config(activations, tmp_path, resume="auto", tokens=256 * 32))
    longer.load(latest_checkpoint(tmp_path))
    assert longer.step == 24
    longer.fit()
    assert longer.step == 32
    with pytest.raises(CheckpointError, match="different training config"):
        Trainer(_config(activations, tmp_path, resume="auto", k=5)).load(
            latest_checkpoint(tmp_path)
        )


# --- resume after a kill ---------------------------------------------------------------


def test_resume_drops_the_killed_runs_log_lines_and_skips_incomplete_checkpoints(
    tmp_path, activations
):
    run = tmp_path / "run"
    Trainer(_config(activations, run)).fit()
    ckpts = run / "checkpoints"
    saved = sorted(p.name for p in ckpts.iterdir())
    assert saved == ["step-00000006", "step-00000012", "step-00000024"]
    # killed after logging step 24 but before the checkpoints of steps 12 and 24 landed
    for name in saved[1:]:
        shutil.rmtree(ckpts / name)
    # a newer checkpoint missing files (copied half-way) is passed over
    (ckpts / "step-00000020").mkdir()
    (ckpts / "step-00000020" / "config.json").write_text("{}")
    assert latest_checkpoint(run).name == "step-00000006"
    args = [f"dataset={activations}", "n_latents=192", "k=6", "batch_size=256", "tokens=6144",
            "warmup_steps=3", "lr=2e-3", "dead_tokens=2048", f"out_dir={run}", "log_every=4",
            "checkpoints=2", "progress=false", "resume=auto"]  # fmt: skip
    assert main(args) == 0
    steps = [json.loads(x)["step"] for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(4, 25, 4))  # each step once, in order


def test_a_bit_flip_in_a_checkpoint_is_refused(tmp_path, activations):
    config = _config(activations, tmp_path / "run", tokens=256 * 4, checkpoints=0)
    Trainer(config).fit()
    ckpt = latest_checkpoint(tmp_path / "run")
    assert set(json.loads((ckpt / "checksums.json").read_text())) == {
        "sae.safetensors", "trainer_state.pt", "config.json"
    }  # fmt: skip
    Trainer(replace(config, resume="auto")).load(ckpt)  # intact: accepted
    data = bytearray((ckpt / "sae.safetensors").read_bytes())
    data[-5] ^= 0x10  # one bit of the last weights
    (ckpt / "sae.safetensors").write_bytes(bytes(data))
    with pytest.raises(
        CheckpointError, match=r"sae.safetensors does not match its recorded sha256"
    ):
        Trainer(replace(config, resume="auto")).load(ckpt)


# --- defaults and held-out evaluation ----------------------------------------------------


def test_schedule_and_dead_window_follow_the_run_length(tmp_path, activations):
    short = Trainer(_config(activations, tmp_path, warmup_steps=0, dead_tokens=0, tokens=256 * 200))
    assert short.warmup_steps == 10  # 5 % of 200 steps
    assert short.lr_at(0) == pytest.approx(short.config.learning_rate / 10)
    assert short.lr_at(50) == short.config.learning_rate
    assert short.lr_at(199) < short.config.learning_rate / 20  # decayed at the end
    assert short.dead_tokens == 256 * 200 // 10  # a tenth of a short run
    # at most 1,024 times the average latent's interval between firings, n / k tokens
    assert SAEConfig(n_latents=1024, k=12).dead_window(4_194_304) == 1024 * 1024 // 12
    assert SAEConfig(n_latents=1024, k=4, batch_size=4096).dead_window(10**4) == 4096
    assert SAEConfig(n_latents=10**6, k=1).dead_window(10**10) == 10_000_000
    assert SAEConfig(d=384, n_latents=16384).learning_rate == pytest.approx(2.8e-3)
    assert SAEConfig(d=384, n_latents=4096).learning_rate == pytest.approx(5.6e-3)
    # a transcoder's is an SAE's at every input width (it steps about its inputs' mean)
    for d in (64, 768):
        assert SAEConfig(d=d, architecture="transcoder", n_latents=4096).learning_rate == (
            pytest.approx(5.6e-3)
        )
    with pytest.warns(UserWarning, match="little room to train: 4 steps, of which 2 warm up"):
        Trainer(_config(activations, tmp_path, warmup_steps=2, tokens=256 * 4))


def test_a_long_runs_default_rate_falls_with_its_length(tmp_path, activations):
    """The default rate holds up to 512 steps, then falls as 1 / steps down to sparsify's
    long-run rate; a rate set by hand is kept; a JumpReLU SAE's thresholds keep the
    short-run rate, in an optimizer group of their own on the same schedule."""
    c = SAEConfig(d=384, n_latents=4096)
    assert c.learning_rate_at(100) == c.learning_rate_at(512) == pytest.approx(5.6e-3)
    assert c.learning_rate_at(4096) == pytest.approx(5.6e-3 / 8)
    assert c.learning_rate_at(10**6) == pytest.approx(4e-4)  # 2e-4 at 16,384 latents
    assert SAEConfig(lr=1e-3).learning_rate_at(10**6) == 1e-3
    long = Trainer(_config(activations, tmp_path, architecture="jumprelu", tokens=256 * 2048,
                           lr=0.0))  # fmt: skip
    assert long.learning_rate == pytest.approx(long.config.learning_rate / 4)
    long.step = 1000  # past the warm-up
    long._schedule()
    _, rest, thresholds = long.optimizer.param_groups
    assert thresholds["params"] == [long.sae.log_threshold]
    assert rest["lr"] == pytest.approx(long.learning_rate)
    assert thresholds["lr"] == pytest.approx(long.config.learning_rate)
    set_by_hand = Trainer(_config(activations, tmp_path, architecture="jumprelu",
                                  jumprelu_threshold_lr=0.05, tokens=256 * 10))  # fmt: skip
    set_by_hand._schedule()
    assert set_by_hand.optimizer.param_groups[2]["lr"] == pytest.approx(
        0.05 * set_by_hand.lr_at(0) / set_by_hand.learning_rate
    )


def test_the_tied_encoder_starts_at_the_least_squares_scale(tmp_path, activations):
    """The encoder starts as the decoder's transpose times the scale that makes the first
    reconstruction least-squares right (the FVU at it is below the unscaled tied SAE's and
    below that of any other scale), and its learning rate is scaled the same."""
    trainer = Trainer(_config(activations, tmp_path / "run", n_latents=384, k=16))
    sae = trainer.sae
    x = next(iter(trainer.loader))["activation"]
    trainer.init_from_data(x)
    ratio = sae.encoder_weight.detach() / sae.decoder_weight.detach()
    scale = float(ratio.mean())
    torch.testing.assert_close(ratio, torch.full_like(ratio, scale))  # still tied
    assert 0.05 < scale < 0.95

    def fvu(s: float) -> float:
        with torch.no_grad():
            x_hat = sae(x).x_hat  # the code scales with the encoder, the choice does not
            b = sae.decoder_bias
            x_hat = b + (x_hat - b) * (s / scale)
        return float((x_hat - x).pow(2).sum() / (x - x.mean(0)).pow(2).sum())

    assert fvu(scale) < min(fvu(0.8 * scale), fvu(1.25 * scale), 0.8 * fvu(1.0))
    # the encoder's steps scale with it: Adam's first step moves each weight by the lr
    assert trainer.encoder_lr_scale == pytest.approx(scale, rel=1e-5)
    enc, dec = sae.encoder_weight.detach().clone(), sae.decoder_weight.detach().clone()
    metrics = trainer.train_step(x)
    enc_step = (sae.encoder_weight.detach() - enc).abs().max()
    assert float(enc_step) == pytest.approx(metrics["lr"] * scale, rel=1e-3)
    assert float((sae.decoder_weight.detach() - dec).abs().max()) > 1.5 * float(enc_step)
    transcoder = Trainer(_config(activations, tmp_path / "tc", architecture="transcoder",
                                 target_dataset=str(activations)))  # fmt: skip
    before = transcoder.sae.encoder_weight.detach().clone()
    transcoder.init_from_data(x, inputs=x)
    assert torch.equal(transcoder.sae.encoder_weight.detach(), before)  # its own init
    torch.testing.assert_close(transcoder.sae.input_mean, x.mean(0))  # its steps' centre
    # fine-tuning (init_from) keeps every weight and re-centres the steps on its data
    kept = {n: p.detach().clone() for n, p in transcoder.sae.named_parameters()}
    transcoder.init_from_data(x + 1, inputs=x + 1, fine_tune=True)
    torch.testing.assert_close(transcoder.sae.input_mean, x.mean(0) + 1)
    assert all(torch.equal(p, kept[n]) for n, p in transcoder.sae.named_parameters())


def test_held_out_figures_in_the_log_the_checkpoint_and_the_summary(tmp_path, capsys):
    from pyspark_safetensors.sae.evaluate import evaluate_sae, held_out_batches, split_by_sample
    from pyspark_safetensors.sae.model import TopKSAE, dense_reference

    rng = np.random.default_rng(1)
    dictionary = rng.standard_normal((96, 32)).astype(np.float32)
    codes = (rng.random((4096, 96)) < 4 / 96) * rng.uniform(0.5, 2, (4096, 96))
    x = (codes @ dictionary + 1).astype(np.float32)
    text_of = np.arange(len(x)) // 16  # 16 tokens per text
    write_batch_dataset(tmp_path / "all", {"activation": x, "sample_id": text_of})
    train, val = split_by_sample(tmp_path / "all", tmp_path / "split", val_fraction=0.25)
    ids = {p.name: set(open_dataset_ids(p)) for p in (train, val)}
    assert not ids["train"] & ids["val"] and len(ids["val"]) == 64  # whole texts held out

    run = tmp_path / "run"
    args = [f"dataset={train}", f"val_dataset={val}", "n_latents=96", "k=4", "batch_size=256",
            "tokens=12288", "lr=5e-3", f"out_dir={run}", "progress=false", "checkpoints=2",
            "log_every=8"]  # fmt: skip
    assert main(args) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 0 < summary["val_fvu"] < 0.5 and summary["val_l0"] == pytest.approx(4, abs=0.3)
    assert {"val_dead_fraction", "val_dense_fraction"} <= set(summary)
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    held = [r["step"] for r in lines if "val_fvu" in r]
    assert held[-1] == 48 and len(held) >= 2
    tensors, meta = load_sae(run / "sae.safetensors")
    assert meta["metrics"]["val_fvu"] == summary["val_fvu"]
    # the evaluator agrees with the plain dense computation
    sae = TopKSAE(32, 96, 4)
    sae.load_full_state(tensors)
    xv = torch.cat(list(held_out_batches(val)))
    with torch.no_grad():
        want = ((dense_reference(sae, xv) - xv) ** 2).sum() / ((xv - xv.mean(0)) ** 2).sum()
    got = evaluate_sae(sae, held_out_batches(val, batch=100))
    assert got["fvu"] == pytest.approx(float(want), rel=1e-4)
    assert got["tokens"] == len(xv) and got["frequency"].shape == (96,)
    with pytest.raises(ValueError, match="no column 'text_id' to split by"):
        split_by_sample(tmp_path / "all", tmp_path / "x", sample_column="text_id")


def open_dataset_ids(path):
    from pyspark_safetensors.torch import open_dataset

    ds = open_dataset(path)
    return np.concatenate([ds.shard_view(i, "sample_id") for i in range(len(ds.counts))]).tolist()


@pytest.mark.trained
def test_batch_topk_training_records_its_threshold(tmp_path, activations, seed, figure):
    """Spread over seeds 0-4 on the pinned CPU path, identical at 1 and 2 threads
    (tests/margins.py): FVU 0.368-0.378 (< 0.5, margin +24 %)."""
    from pyspark_safetensors.sae import export_sae, load_sae_model, read_sae

    trainer = Trainer(_config(activations, tmp_path / "run", architecture="batchtopk",
                              tokens=256 * 40, lr=5e-3, seed=seed))  # fmt: skip
    metrics = trainer.fit()
    assert metrics["l0"] == pytest.approx(6, abs=0.01)  # k x batch per batch
    figure("fvu", metrics["fvu"], below=0.5)
    sae = load_sae_model(tmp_path / "run")
    assert sae.architecture == "batchtopk" and not sae.training
    assert float(trainer.sae.threshold) > 0
    assert float(sae.threshold) == pytest.approx(float(trainer.sae.threshold))
    x = trainer.loader.batches.read_batch(np.arange(512))["activation"]
    with torch.no_grad():
        l0 = float((sae(x).values > 0).sum(1).float().mean())
    assert 3 < l0 < 12  # the threshold keeps about k per row on average
    # SAELens takes it as it saves its own: a JumpReLU at the learned threshold
    export_sae(tmp_path / "run", tmp_path / "x", "saelens")
    exported, info = read_sae(tmp_path / "x")
    assert info["architecture"] == "jumprelu"
    torch.testing.assert_close(exported["threshold"], torch.full_like(exported["threshold"],
                                                                      float(sae.threshold)))  # fmt: skip


def test_optional_metric_sinks(tmp_path, activations):
    pytest.importorskip("tensorboard")  # in the dev extra
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trainer = Trainer(_config(activations, tmp_path, log_to=("tensorboard",)))
    trainer.fit()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    fvu = events.Scalars("fvu")
    assert [e.step for e in fvu] == [h["step"] for h in trainer.history]
    assert fvu[-1].value == pytest.approx(trainer.history[-1]["fvu"], rel=1e-6)
    with pytest.raises(ValueError, match="unknown sink 'mlflow'"):
        Trainer(_config(activations, tmp_path / "b", log_to=("mlflow",)))


def test_a_rank_shows_mistakes_in_one_line_and_bugs_with_their_traceback(
    tmp_path, activations, monkeypatch, capsys
):
    from pyspark_safetensors.sae import train

    bad = tmp_path / "bad.toml"
    bad.write_text("k = = 3\n")
    assert main(["--config", str(bad)]) == 2
    assert "not TOML" in capsys.readouterr().err

    def broken(config, mesh=None):
        raise ValueError("an internal invariant broke")

    monkeypatch.setattr(train, "Trainer", broken)
    with pytest.raises(ValueError, match="an internal invariant broke"):
        main([f"dataset={activations}", f"out_dir={tmp_path / 'run'}", "k=4"])

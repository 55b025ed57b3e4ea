"""The main job, end to end on an embedded local Spark:

1. extract: Python's own documentation topics (``pydoc_data.topics``) in passages, run
   through all-MiniLM-L6-v2 inside Spark; the input of layer 0's attention projections
   (shared by query, key and value) written as a token-level dataset + a KV dataset;
2. train: a TopK SAE on those activations (the distributed trainer, one process here);
3. lut: lookup tables for query, key and value of layer 0 from that one SAE;
4. evaluate: on passages the SAE never saw, the LUT layers against the exact layers, and
   the sentence embeddings of the model with its LUT layers against the original.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

HOOK = "encoder.layer.0.attention.self.query:input"
LAYERS = [f"encoder.layer.0.attention.self.{p}" for p in ("query", "key", "value")]


def demo_passages(max_chars: int = 400) -> list[tuple[str, str]]:
    """(topic, passage) pairs from Python's own documentation topics."""
    from pydoc_data.topics import topics

    out = []
    for topic in sorted(topics):
        text = topics[topic]
        for i in range(0, len(text), max_chars):
            chunk = text[i : i + max_chars].strip()
            if chunk:
                out.append((f"{topic}#{i // max_chars}", chunk))
    return out


def passages_by_key(skip: int, count: int) -> list[str]:
    """``count`` distinct passages after the first ``skip``, in the order the extraction
    takes them (by key, the sha256 of the text): ``skip = texts`` gives held-out ones."""
    texts = sorted(
        {t for _, t in demo_passages()}, key=lambda t: hashlib.sha256(t.encode()).hexdigest()
    )
    return texts[skip : skip + count]


def run_demo(
    out: Path, *, texts: int = 600, epochs: int = 4, expansion: int = 8, k: int = 32
) -> dict:
    """Run the four stages into ``out``; returns the figures it prints."""
    import torch

    from .extract import ExtractConfig, Extractor, default_model_dir, run_extraction
    from .lut import embedding_agreement, evaluate, precompute_lut
    from .sae import SAEConfig
    from .sae.train import Trainer
    from .spark.session import local_session

    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    model_dir = default_model_dir()

    print(f"[1/4] extract: {texts} passages of pydoc_data.topics through all-MiniLM-L6-v2 in Spark")
    spark = local_session("local[*]")
    try:
        summary = run_extraction(
            spark, ExtractConfig(hooks=(HOOK,), max_texts=texts, max_length=128), out / "extract"
        )
    finally:
        spark.stop()
    print(f"      {summary}")

    dataset = out / "extract" / "activations" / HOOK.replace(":", ".").replace(".", "_")
    print(
        f"[2/4] train: TopK SAE (n = {expansion} x 384, k = {k}) on {summary.tokens:,} tokens x {epochs} epochs"
    )
    config = SAEConfig(
        dataset=str(dataset), expansion_factor=expansion, k=k, batch_size=1024,
        tokens=summary.tokens * epochs,
        out_dir=str(out / "sae"), log_every=10, checkpoints=3,
    )  # fmt: skip
    metrics = Trainer(config).fit()
    print(
        f"      FVU {metrics['fvu']:.3f}, L0 {metrics['l0']:.1f}, dead {metrics['dead_fraction']:.1%}"
    )

    print("[3/4] lut: query, key and value of layer 0 from the one SAE of their shared input")
    sae_file = out / "sae" / "sae.safetensors"
    meta = precompute_lut(
        model_dir, dict.fromkeys(LAYERS, sae_file), out_dir=out / "lut", progress=False
    )
    print(
        f"      {len(meta['layers'])} layer files, {meta['timing']['flops_per_s'] / 1e9:.1f} GFLOP/s"
    )

    print("[4/4] evaluate on held-out passages")
    held_out = passages_by_key(texts, 64)
    extractor = Extractor(model_dir, [HOOK], max_length=128)
    x = torch.cat(
        [torch.from_numpy(w.activations[HOOK].astype("float32")) for w in extractor.run(held_out)]
    )
    rows = evaluate(out / "lut", model_dir, {layer: x for layer in LAYERS}, ks=[k // 2, k, 2 * k],
                    ms=[0, 32], out_dir=out / "evaluation")  # fmt: skip
    cos = {m: embedding_agreement(model_dir, out / "lut", held_out, compensate=m) for m in (0, 32)}
    at_k = [r for r in rows if r["k"] == k]
    for r in at_k:
        print(
            f"      {r['layer'].rsplit('.', 1)[1]:>5} m={r['m']:>2}: relative L2 {r['rel_l2']:.3f}, cosine {r['cosine']:.4f}"
        )
    print(
        f"      sentence embeddings, LUT layers vs original: cosine {cos[0]:.4f} (m=0), {cos[32]:.4f} (m=32)"
    )
    report = (out / "evaluation" / "evaluation.md").read_text()
    (out / "evaluation" / "evaluation.md").write_text(
        report
        + f"\nSentence-embedding cosine, patched vs original: {cos[0]:.4f} (m=0), {cos[32]:.4f} (m=32)\n"
    )
    return {
        "tokens": summary.tokens,
        "fvu": metrics["fvu"],
        "embedding_cosine": cos,
        "layers": at_k,
    }

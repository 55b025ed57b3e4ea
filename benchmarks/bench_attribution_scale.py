"""Partial attribution at the scale where full attribution no longer fits: a toy Llama of
8 layers, hidden 256, a cross-layer transcoder of 2,048 latents per layer, prompts of 128
tokens; our ``graphs.attribution`` against circuit-tracer 0.5.0's ``attribute`` at
``max_feature_nodes`` 256, 1,024 and 4,096, on the same prompts, CPU and threads: seconds
per prompt and each process's peak resident memory above the loaded model.

    python -m benchmarks attribution_scale
    SCALE_PROMPTS=4 SCALE_LIMITS=256,1024 python -m benchmarks attribution_scale

The model and CLT have random weights (a graph's cost depends on the numbers of layers,
tokens, active features and logits, not on what the features mean); the CLT's JumpReLU
thresholds keep about ``K`` latents per layer and token (both sides encode by them,
circuit-tracer's only rule for a CLT). Each (side, limit) runs in a fresh process: load,
then the prompts timed (each takes seconds: nothing to warm up); the peak is
``ru_maxrss`` minus the resident memory after loading. circuit-tracer runs in ``.venv-circuit-tracer``
(``bench_circuit_tracer.SETUP``) with its TransformerLens backend, at its default batch
size (512) and ours at ours (64); both take circuit-tracer's position-0 convention.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .bench_circuit_tracer import ROOT, SETUP, VENV, for_transformers_4
from .common import table

LAYERS, HIDDEN, HEADS, N_LATENTS, K, TOKENS = 8, 256, 4, 2048, 32, 128
LIMITS = (256, 1024, 4096)
MAX_LOGITS, LOGIT_PROB = 10, 0.95


def _rss() -> float:
    """This process's resident memory now, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _peak() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def prepare(root: Path, n: int) -> dict:
    """The random model (and its transformers-4 copy), the CLT (ours and exported) and
    ``n`` prompts of ``TOKENS`` tokens under ``root``; ``inputs.json``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from pyspark_safetensors.extract.corpus import passages_by_key
    from pyspark_safetensors.extract.toy_lm import TINY, toy_lm
    from pyspark_safetensors.sae.architectures import CrossLayerTranscoder
    from pyspark_safetensors.sae.checkpoint import save_sae
    from pyspark_safetensors.sae.ecosystem import export_sae

    toy = toy_lm(Path(tempfile.gettempdir()) / "pss-bench-toy-lm", TINY)  # its tokenizer
    tok = AutoTokenizer.from_pretrained(toy)
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=HIDDEN, intermediate_size=4 * HIDDEN,
                      num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                      num_key_value_heads=HEADS, max_position_embeddings=TOKENS,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                      tie_word_embeddings=False)  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    texts = " ".join(passages_by_key(0, 1 << 30, 400))
    ids = tok(texts)["input_ids"]
    prompts = [[tok.bos_token_id, *ids[i * TOKENS : (i + 1) * TOKENS - 1]] for i in range(n)]
    # the CLT: random weights, thresholds at each latent's (1 - K/n) quantile over the
    # prompts' tokens (position 0 aside)
    hooks = [f"model.layers.{i}.mlp:input" for i in range(LAYERS)]
    clt = CrossLayerTranscoder(HIDDEN, N_LATENTS, K, d_out=HIDDEN, n_layers=LAYERS, seed=0,
                               hook_points=hooks,
                               target_hook_points=[h.replace("input", "output") for h in hooks])  # fmt: skip
    state = clt.full_state()
    xs = [[] for _ in range(LAYERS)]
    handles = [layer.mlp.register_forward_pre_hook(lambda m, a, i=i: xs[i].append(a[0][:, 1:].flatten(0, 1)))
               for i, layer in enumerate(model.model.layers)]  # fmt: skip
    with torch.no_grad():
        model(input_ids=torch.tensor(prompts))
    for h in handles:
        h.remove()
    pre = [torch.cat(x) @ state["encoder_weight"][i].T + state["encoder_bias"][i]
           for i, x in enumerate(xs)]  # fmt: skip
    state["threshold"] = torch.stack([p.quantile(1 - K / N_LATENTS, dim=0) for p in pre]).clamp_min(
        0
    )
    clt.load_full_state(state)
    save_sae(root / "clt.safetensors", clt.full_state(), clt.metadata())
    export_sae(root / "clt.safetensors", root / "ct-clt", "circuit-tracer")
    inputs = {"root": str(root), "model": str(model_dir),
              "model4": str(for_transformers_4(model_dir, root / "model4")), "prompts": prompts}  # fmt: skip
    (root / "inputs.json").write_text(json.dumps(inputs))
    return inputs


def ours(root: Path, limit: int) -> dict:
    """Our side, in this process: seconds per prompt, features, peak memory."""
    import torch

    from pyspark_safetensors.circuits import ReplacementModel, clt_replacement
    from pyspark_safetensors.extract.model import load_model
    from pyspark_safetensors.graphs.attribution import AttributionConfig, attribute_local

    inputs = json.loads((root / "inputs.json").read_text())
    _, model = load_model(inputs["model"])
    for p in model.parameters():
        p.requires_grad_(False)
    rm = ReplacementModel(model, clt_replacement(model, root / "clt.safetensors", rule="threshold"))
    config = AttributionConfig(MAX_LOGITS, LOGIT_PROB, max_feature_nodes=limit)
    base, times, active = _rss(), [], []
    for ids in inputs["prompts"]:
        started = time.perf_counter()
        graph = attribute_local(rm.capture(torch.tensor(ids), first_position=False), config)
        times.append(time.perf_counter() - started)
        active.append(graph.n_active)
    return {"seconds": times, "active": active, "peak": _peak() - base}


def theirs(root: Path, limit: int) -> dict:
    """circuit-tracer's side, in ``.venv-circuit-tracer``."""
    import torch
    from circuit_tracer import attribute

    from .bench_circuit_tracer import _their_model, _their_transcoders

    inputs = json.loads((root / "inputs.json").read_text())
    model = _their_model(inputs, _their_transcoders(inputs, "clt"), "transformerlens")
    base, times = _rss(), []
    for ids in inputs["prompts"]:
        started = time.perf_counter()
        attribute(torch.tensor(ids), model, max_n_logits=MAX_LOGITS,
                  desired_logit_prob=LOGIT_PROB, max_feature_nodes=limit)  # fmt: skip
        times.append(time.perf_counter() - started)
    return {"seconds": times, "peak": _peak() - base}


def _side(python: Path, side: str, root: Path, limit: int) -> dict:
    """One (side, limit) in a fresh process."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = root / f"{side}-{limit}.json"
    subprocess.run([str(python), "-m", "benchmarks.bench_attribution_scale", side, str(root),
                    str(limit), str(out)], cwd=ROOT, check=True, env=env)  # fmt: skip
    return json.loads(out.read_text())


def run() -> str:
    import statistics

    import torch

    n = int(os.environ.get("SCALE_PROMPTS", 2))
    limits = [int(x) for x in os.environ.get("SCALE_LIMITS", ",".join(map(str, LIMITS))).split(",")]
    have_theirs = (VENV / "bin" / "python").exists()
    load = f"{os.getloadavg()[0]:.2f}"
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        prepare(root, n)
        for limit in limits:
            mine = _side(Path(sys.executable), "ours", root, limit)
            their = _side(VENV / "bin" / "python", "theirs", root, limit) if have_theirs else None
            m = statistics.median(mine["seconds"])
            t = statistics.median(their["seconds"]) if their else None
            rows.append([
                limit, f"{statistics.mean(mine['active']):,.0f}", f"{m:.2f}",
                f"{t:.2f}" if t else "-", f"{t / m:.2f}x" if t else "-",
                f"{mine['peak']:,.0f}", f"{their['peak']:,.0f}" if their else "-",
            ])  # fmt: skip
    setup = (
        ""
        if have_theirs
        else f"\n\ncircuit-tracer not run: no .venv-circuit-tracer. Make it with:\n\n```\n{SETUP}\n```"
    )
    return (
        f"## Partial attribution at scale: {LAYERS} layers, hidden {HIDDEN}, a CLT of "
        f"{N_LATENTS:,} latents a layer, {TOKENS}-token prompts\n\n"
        + table(
            [
                "max_feature_nodes",
                "active features per prompt",
                "ours s/prompt",
                "circuit-tracer s/prompt",
                "ours faster by",
                "ours peak MiB",
                "circuit-tracer peak MiB",
            ],
            rows,
        )
        + f"\n\nMedian over {n} prompts, each (side, limit) in a fresh "
        "process; peak: the process's maximum resident memory above what it held once the "
        "model and CLT were loaded. Random weights, thresholds keeping about "
        f"{K} latents per layer and token; circuit-tracer 0.5.0 on its TransformerLens "
        "backend at its default batch size (512), ours at ours (64); both without nodes at "
        f"position 0 (circuit-tracer's convention). torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; load average before the run: {load}. Command: "
        "python -m benchmarks attribution_scale." + setup
    )


if __name__ == "__main__":
    side, root, limit, out = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4])
    result = (ours if side == "ours" else theirs)(root, limit)
    out.write_text(json.dumps(result))

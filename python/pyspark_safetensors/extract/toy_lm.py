"""A small Llama trained here, offline, the way a researcher makes a toy model: a byte-level
BPE tokenizer (``tokenizers``) and a ``transformers`` Llama of a few layers, trained on the
demo corpus on the CPU, deterministically (seeded), saved as an ordinary Hugging Face
model directory that ``AutoTokenizer`` and ``AutoModelForCausalLM`` load (and so does the
extraction: ``ExtractConfig(model=str(path))``).

Like Llama's and GPT-2's, the tokenizer has no pad token and puts a BOS token before every
text. ``toy_lm`` caches the model under a name made of the content hash of its config and
training texts, as the pipeline's stages are cached; ``train_toy_lm`` trains one into a
directory. ``toy_lm.json`` in the directory records the config and the losses: the model's
held-out next-token cross-entropy beside a unigram model's. Where the environment variable
``PYSPARK_SAFETENSORS_TOY_CACHE`` names a directory, every process asking for the same toy
model (this one and ``toy_vit``'s) copies it from there, trained once (``cached_toy``).

    path = toy_lm("out/models")                   # trained once, then reused
    held_out = toy_lm_texts()[1]                  # passages the model never saw
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .corpus import DEMO_PASSAGE_CHARS, passages_by_key
from .model import ExtractionError

BOS, EOS = "<|bos|>", "<|eos|>"
RECORD = "toy_lm.json"
"""Written into the model directory: config, content hash, losses."""
CACHE_ENV = "PYSPARK_SAFETENSORS_TOY_CACHE"
"""The environment variable naming a directory of toy models shared by processes."""


@dataclass(frozen=True)
class ToyLMConfig:
    """What a toy model is: its tokenizer, architecture, training run and texts."""

    vocab_size: int = 4096
    hidden_size: int = 128
    intermediate_size: int = 384
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    """Grouped-query attention, as in Llama 2/3 (k and v narrower than q)."""
    context: int = 128
    """Tokens per training sequence and ``max_position_embeddings``."""
    steps: int = 400
    batch_size: int = 16
    learning_rate: float = 3e-3
    warmup_steps: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    passage_chars: int = DEMO_PASSAGE_CHARS
    held_out_texts: int = 128
    """The last demo passages by key, never trained on: the model's own held-out loss, and
    texts for language-model evaluations."""
    max_texts: int = 0
    """Train on at most this many passages (0 = every passage but the held-out ones)."""


TINY = ToyLMConfig(
    vocab_size=320, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=2,
    num_kv_heads=1, context=64, steps=60, batch_size=8, learning_rate=1e-2, warmup_steps=5,
    held_out_texts=16, max_texts=96,
)  # fmt: skip
"""A config that trains in a second or two (tests)."""


def toy_lm_texts(config: ToyLMConfig = ToyLMConfig()) -> tuple[list[str], list[str]]:
    """(training texts, held-out texts): demo passages in key order, the last
    ``held_out_texts`` held out."""
    texts = passages_by_key(0, 1 << 30, config.passage_chars)
    if config.held_out_texts >= len(texts):
        raise ExtractionError(
            f"held_out_texts {config.held_out_texts} leaves nothing of {len(texts)} passages"
        )
    train, held_out = texts[: -config.held_out_texts], texts[-config.held_out_texts :]
    return (train[: config.max_texts] if config.max_texts else train), held_out


def toy_lm_hash(config: ToyLMConfig = ToyLMConfig()) -> str:
    """sha256 of the config and of the texts it trains on (the demo corpus is Python's
    own documentation, which differs between Python versions)."""
    train, held_out = toy_lm_texts(config)
    texts = hashlib.sha256()
    for text in (*train, "\0", *held_out):
        texts.update(hashlib.sha256(text.encode()).digest())
    body = {**dataclasses.asdict(config), "texts_sha256": texts.hexdigest(), "kind": "llama"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def toy_lm(
    root: str | os.PathLike, config: ToyLMConfig = ToyLMConfig(), *, progress: bool = False
) -> Path:
    """The model directory ``root/toy-llama-{hash[:16]}``: trained and published whole
    the first time, reused afterwards (its ``toy_lm.json`` records the losses)."""
    digest = toy_lm_hash(config)
    final = Path(root) / f"toy-llama-{digest[:16]}"
    if (final / RECORD).is_file():
        return final
    return cached_toy(
        final, f"toy-llama-{digest}", lambda d: train_toy_lm(d, config, progress=progress)
    )


def cached_toy(final: Path, key: str, train: Callable[[Path], object]) -> Path:
    """Publish at ``final`` the toy model ``key`` names (its kind and content hash), which
    ``train(directory)`` trains. Where ``$PYSPARK_SAFETENSORS_TOY_CACHE`` names a
    directory, the model is trained there once and copied from there: processes asking
    for it at the same time wait for the one training it (a file lock), and the key also
    names what else makes torch's arithmetic differ between processes (its threads, its
    deterministic mode), so a copy has the bytes this process would train. A cached model
    is never retrained: the variable is meant for one run of one version of the code."""
    from ..dataset.publish import publishing

    cache = os.environ.get(CACHE_ENV)
    with publishing(final) as staging:
        if cache:
            shutil.copytree(_trained_once(Path(cache), key, train), staging, dirs_exist_ok=True)
        else:
            train(staging)
    return final


def _trained_once(cache: Path, key: str, train: Callable[[Path], object]) -> Path:
    """``cache/key-{torch's settings}``, trained by the first process to ask for it."""
    import torch

    from ..dataset.publish import publishing

    deterministic = "-deterministic" if torch.are_deterministic_algorithms_enabled() else ""
    cached = cache / f"{key}-threads{torch.get_num_threads()}{deterministic}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{cached.name}.lock", "a") as lock:
        _lock(lock)  # released when the file closes, or its process dies
        if not cached.is_dir():
            with publishing(cached) as staging:
                train(staging)
    return cached


def _lock(file) -> None:
    """An exclusive lock on an open file, held until it closes (a no-op without
    ``fcntl``: two processes may then both train, and the last one published wins)."""
    try:
        import fcntl
    except ImportError:  # Windows
        return
    fcntl.flock(file.fileno(), fcntl.LOCK_EX)


def train_byte_bpe(texts: list[str], vocab_size: int):
    """A byte-level BPE tokenizer (``tokenizers``) trained on ``texts`` that puts BOS
    before every text and has no pad token, wrapped for ``transformers``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(
            single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
        ),
    ])  # fmt: skip
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS)


def train_toy_lm(
    out_dir: str | os.PathLike, config: ToyLMConfig = ToyLMConfig(), *, progress: bool = False
) -> dict:
    """Train the tokenizer and the model on ``toy_lm_texts(config)`` and save both into
    ``out_dir`` (created); returns what ``toy_lm.json`` records (and the seconds taken).
    Same config, same machine: the same bytes. ``progress``: a bar with the loss."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    started = time.perf_counter()
    out_dir = Path(out_dir)
    train_texts, held_out = toy_lm_texts(config)
    tokenizer = train_byte_bpe(train_texts, config.vocab_size)
    tokenizer.model_max_length = config.context
    train = _encode(tokenizer, train_texts, config.context)
    test = _encode(tokenizer, held_out, config.context)

    torch.manual_seed(config.seed)
    model_config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_kv_heads,
        max_position_embeddings=config.context,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=None,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(model_config)
    losses = _train(model, train, config, progress)
    model.eval()
    record = {
        "config": dataclasses.asdict(config),
        "hash": toy_lm_hash(config),
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_tokens": sum(len(ids) - 1 for ids in train),
        "final_train_loss": losses[-1],
        "held_out_loss": mean_next_token_loss(model, test),
        "unigram_held_out_loss": unigram_loss(train, test, len(tokenizer)),
        "seconds": time.perf_counter() - started,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # the time is not part of the model: leave it out of the directory's bytes
    saved = {k: v for k, v in record.items() if k != "seconds"}
    (out_dir / RECORD).write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")
    return record


def _encode(tokenizer, texts: list[str], context: int) -> list[list[int]]:
    """Each text as BOS + tokens, cut to ``context`` tokens (texts of one token dropped:
    nothing to predict)."""
    ids = tokenizer(texts, truncation=True, max_length=context)["input_ids"]
    return [row for row in ids if len(row) > 1]


def _batch(rows: list[list[int]]):
    """(input_ids, attention_mask, labels) right-padded; labels -100 where padded."""
    import torch

    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = 1
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _loss(model, rows: list[list[int]]):
    """Mean next-token cross-entropy over the real tokens of ``rows``."""
    import torch.nn.functional as F

    ids, mask, labels = _batch(rows)
    logits = model(input_ids=ids, attention_mask=mask).logits
    return F.cross_entropy(
        logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100
    )


def _train(model, rows: list[list[int]], config: ToyLMConfig, progress: bool) -> list[float]:
    """AdamW, linear warm-up then cosine decay; batches drawn by a seeded generator."""
    import torch
    from tqdm.auto import tqdm

    gen = torch.Generator().manual_seed(config.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    other = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": config.weight_decay},
         {"params": other, "weight_decay": 0.0}],
        lr=config.learning_rate, betas=(0.9, 0.95),
        # fused: ATen's own step, the same bits on every CPU (the default per-tensor
        # step takes MKL's sqrt, which differs between AMD and Intel)
        fused=True,
    )  # fmt: skip

    def lr_at(step: int) -> float:
        if step < config.warmup_steps:
            return (step + 1) / config.warmup_steps
        progress = (step - config.warmup_steps) / max(1, config.steps - config.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    model.train()
    losses = []
    bar = tqdm(range(config.steps), desc="toy LM", unit="step", disable=not progress)
    for _ in bar:
        pick = torch.randint(len(rows), (config.batch_size,), generator=gen).tolist()
        loss = _loss(model, [rows[i] for i in pick])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        bar.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    return losses


def mean_next_token_loss(model, rows: list[list[int]], batch_size: int = 32) -> float:
    """The model's mean next-token cross-entropy (nats) over every predicted token."""
    import torch

    total, count = 0.0, 0
    with torch.inference_mode():
        for start in range(0, len(rows), batch_size):
            part = rows[start : start + batch_size]
            n = sum(len(r) - 1 for r in part)
            total += float(_loss(model, part)) * n
            count += n
    return total / count


def unigram_loss(train: list[list[int]], test: list[list[int]], vocab: int) -> float:
    """Cross-entropy (nats) on ``test``'s predicted tokens of the unigram distribution of
    ``train``'s (add-one smoothed): the baseline a language model must beat."""
    import numpy as np

    counts = np.ones(vocab)
    for row in train:
        np.add.at(counts, row[1:], 1)
    logp = np.log(counts / counts.sum())
    return float(-np.mean(np.concatenate([logp[row[1:]] for row in test])))

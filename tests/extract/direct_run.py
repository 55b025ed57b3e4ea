"""The reference an extraction is checked against: the model run directly on each window of
each text alone (a batch of one, no padding), its hook points captured by hand."""

import torch

from pyspark_safetensors.extract.model import load_model


def run_directly(model_dir, hooks, texts, max_length):
    """``(tokenizer, {(text, window): {hook: [seq, H]}})`` with the BOS position included;
    ``module:input`` is the module's first argument, ``module:output`` its output."""
    tokenizer, model = load_model(model_dir)
    modules = dict(model.named_modules())
    seen = {}
    for hook in hooks:
        module, _, where = hook.rpartition(":")
        if where == "input":
            modules[module].register_forward_pre_hook(
                lambda m, args, hook=hook: seen.__setitem__(hook, args[0]))  # fmt: skip
        else:
            modules[module].register_forward_hook(
                lambda m, args, out, hook=hook: seen.__setitem__(
                    hook, out[0] if isinstance(out, tuple) else out))  # fmt: skip
    out = {}
    with torch.inference_mode():
        for t, text in enumerate(texts):
            enc = tokenizer(text, truncation=True, max_length=max_length,
                            return_overflowing_tokens=True)  # fmt: skip
            for w, ids in enumerate(enc["input_ids"]):
                model(input_ids=torch.tensor([ids]))
                out[(t, w)] = {h: seen[h][0].float().numpy() for h in hooks}
    return tokenizer, out

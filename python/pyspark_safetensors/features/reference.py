"""The single-process reference: the same encoding, the same state and the same tables, in
one loop over the dataset's shards (no Spark). The tests and the benchmark compare the
Spark job with it. It needs the dataset's rows in token order (as an extraction writes
them): it has no second pass for the windows."""

from __future__ import annotations

import pyarrow as pa

from .config import FeaturesConfig, FeaturesError
from .job import (
    TOKENS_ARROW,
    FeaturesPlan,
    load_encoder,
    new_state,
    pick_device,
    read_texts,
    scan_range,
    tokenize_fn,
    windows_wanted,
)
from .merge import contexts_table, examples_table
from .scan import RowReader
from .state import LatentState


def reference_state(plan: FeaturesPlan, config: FeaturesConfig) -> LatentState:
    """Every token of ``plan.dataset`` (a crosscoder's: of its datasets, concatenated)
    folded into one ``LatentState``, ``batch_tokens`` at a time, each kept entry with its
    context window."""
    ds = plan.open_input()
    device = pick_device(config)
    sae = load_encoder(plan.sae, device, config.threads, plan.clt_layer)
    state = new_state(plan, config)
    scan_range(state, RowReader(ds, plan.width), 0, len(ds), sae, config, device, span=plan.span,
               positions=plan.positions())  # fmt: skip
    return state


def reference_contexts(plan: FeaturesPlan, config: FeaturesConfig, state: LatentState) -> pa.Table:
    """The contexts table (``merge.contexts_table``) of ``state``'s examples, their
    samples' texts read and tokenized in this process."""
    if state.out_of_order:
        raise FeaturesError(f"{plan.dataset}: rows not in token order; the loop needs them so")
    examples = examples_table(state, config)
    wanted = windows_wanted(examples)
    texts = read_texts(plan.extraction_location(), sorted({s for s, _ in wanted}))
    batches = list(tokenize_fn(plan, wanted, config.context)(texts.to_batches()))
    tokens = pa.Table.from_batches(batches, schema=TOKENS_ARROW)
    return contexts_table(examples, tokens, config.context)

"""The next-token loss computed by hand, the judge of the LUT evaluation's figures."""

import torch
import torch.nn.functional as F


def next_token_logps(logits: torch.Tensor, batch: dict) -> tuple[float, int, list[torch.Tensor]]:
    """(summed next-token CE, predicted tokens, each row's log-probabilities [n - 1, vocab])
    of one padded batch's ``logits``, in float64, over each row's real tokens."""
    total, count, logps = 0.0, 0, []
    ids, mask = batch["input_ids"], batch["attention_mask"]
    for row in range(ids.shape[0]):
        n = int(mask[row].sum())
        logp = F.log_softmax(logits[row, : n - 1].double(), dim=-1)
        total -= float(logp[torch.arange(n - 1), ids[row, 1:n]].sum())
        count += n - 1
        logps.append(logp)
    return total, count, logps

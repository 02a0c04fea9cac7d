"""The emitted tokens' log-probabilities (``logprobs=``, contract v1.3): the definition every backend matches.

Each emitted token is scored under the target row it was emitted from: an
accepted draft under its position's row, the target's own token under the
row it was drawn from (the residual's row, or the bonus row), whatever rule
chose it. ``"raw"`` is that row as given: ``log_softmax`` of logits, or the
log of the given probability. ``"processed"`` is the distribution
verification used (after temperature and truncation, ``_rows``); greedy
requests report the raw value there. A ``-1`` token gets ``-inf`` (this rule
first); a token emitted from a row the call was not given (the bonus id in
the bonus-free packed layout) gets NaN.
"""

from __future__ import annotations

import torch

from . import _rows, _sampling


def emitted_logprobs(kind: str, target: torch.Tensor, token_rows: torch.Tensor, tokens: torch.Tensor, options,
                     row_given: torch.Tensor | None = None) -> torch.Tensor:
    """float32, the shape of ``tokens [B, W]``: ``log P(tokens[b, w])`` under row ``token_rows[b, w]`` of
    ``target [B, R, V]``.

    ``options`` is the call's ``VerifyOptions`` (temperature, logits and the
    truncation parameters); ``row_given`` (bool ``[B, W]``, default all) says
    where the row was given.
    """
    batch_size, num_rows, _ = target.shape
    rows = token_rows.to(torch.int64).clamp(0, max(num_rows - 1, 0))
    scored = target.gather(1, rows.unsqueeze(-1).expand(-1, -1, target.shape[-1]))
    raw = torch.log_softmax(scored.to(torch.float32), -1) if options.logits else scored.to(torch.float32).log()
    safe_tokens = tokens.to(torch.int64).clamp_min(0).unsqueeze(-1)
    values = raw.gather(-1, safe_tokens).squeeze(-1)
    if kind == "processed":
        processed = _rows.target_distributions(scored, options.temperature, options.logits, options.top_k,
                                               options.top_p, options.min_p)
        sampled = ~_sampling.greedy_requests(options.temperature, batch_size, target.device)
        values = torch.where(sampled.view(-1, 1), processed.gather(-1, safe_tokens).squeeze(-1).log(), values)
    if row_given is not None:
        values = torch.where(row_given, values, float("nan"))
    return torch.where(tokens < 0, -float("inf"), values)

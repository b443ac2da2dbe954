"""When a sequence stops: every rule in one place.

Token rules (EOS, stop token ids, max_tokens, max_model_len) are checked by the scheduler
as each token is appended; stop strings need text, so the front-end's detokenizer checks
them and ends the request through the core (EngineCore.finish_requests). Both obey the
same min_tokens rule: nothing but the length limits can end a sequence before it has
`min_tokens` output tokens (the sampler also masks EOS and stop ids until then).
"""
from __future__ import annotations

from pagedserve.core.request import Request, RequestStatus


def past_min_tokens(num_output_tokens: int, min_tokens: int) -> bool:
    """Whether a sequence with this many output tokens (the newest included) may stop."""
    return num_output_tokens > min_tokens


def check_token_stop(req: Request, token: int, max_model_len: int) -> tuple[RequestStatus | None, int | None]:
    """After `token` was appended to `req`: (finished status, stop reason) or (None, None)."""
    params = req.sampling_params
    num_output = req.num_output_tokens
    if past_min_tokens(num_output, params.min_tokens):
        if not params.ignore_eos and token in req.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
    if num_output >= req.max_tokens or req.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None, None

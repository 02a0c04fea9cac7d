"""The verification bundle (``_verify_options.VerifyOptions``) as the Triton verification kernels take it.

``_chain_verify_kernel`` and ``_tree_verify_kernel`` take the bundle's
arguments in one order and its flags under one set of names; both launchers
pass what these two functions give.
"""

from __future__ import annotations

from .._verify_options import VerifyOptions


# The verification kernels' LOGPROBS (kernels/chain_verify_rows.py: RAW_LOGPROBS, PROCESSED_LOGPROBS) of
# `logprobs=`.
LOGPROBS_FLAGS = {None: 0, "raw": 1, "processed": 2}


def split_words(value: int) -> tuple[int, int]:
    """A 64-bit int as its low and high 32-bit words, each read as a signed 32-bit int.

    Passed this way a seed or offset is always an ``i32`` kernel argument,
    so its value never changes the compiled signature.
    """
    low, high = value & 0xFFFFFFFF, (value >> 32) & 0xFFFFFFFF
    return low - (1 << 32) * (low >> 31), high - (1 << 32) * (high >> 31)


def triton_arguments(options: VerifyOptions, placeholder) -> tuple:
    """temperature, top_k, top_p, min_p, bonus ids, then the seed tensor and the seed's two words, the offset
    tensor and its two words (``placeholder`` for a tensor not given: its flag says so)."""
    tensors = (options.temperature, *options.parameters)
    return (*(placeholder if tensor is None else tensor for tensor in tensors),
            placeholder if options.seed_tensor is None else options.seed_tensor, *split_words(options.seed),
            placeholder if options.offset_tensor is None else options.offset_tensor, *split_words(options.offset))


def triton_flags(options: VerifyOptions) -> dict:
    """The kernels' constexpr flags of the bundle."""
    return dict(
        HAS_TEMPERATURE=options.temperature is not None, LOGITS=options.logits,
        SEED_PER_REQUEST=options.seed_tensor is not None, OFFSET_FROM_TENSOR=options.offset_tensor is not None,
        OFFSET_PER_REQUEST=options.offset_tensor is not None and options.offset_tensor.dim() == 1,
        HAS_TOP_K=options.top_k is not None, HAS_TOP_P=options.top_p is not None,
        HAS_MIN_P=options.min_p is not None, TRUNCATE=options.truncates,
        HAS_BONUS=options.bonus_token_ids is not None,
    )

"""Host-side argument checks with errors that name the argument.

Only metadata (shape, dtype, device) is read, never values, so the checks
cost no device synchronisation. Value checks (ids in range, tree structure)
live with each op and run only under ``validate=True``.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading

import torch

TOKEN_DTYPES = (torch.int32, torch.int64)
# Python-number sampling parameters: (in range, the range in words). NaN is out of every range.
_NUMBER_RANGES = {
    "top_k": (lambda value: value >= 0, ">= 0 (0 = off)"),
    "top_p": (lambda value: 0 < value <= 1, "in (0, 1] (1 = off)"),
    "min_p": (lambda value: 0 <= value <= 1, "in [0, 1] (0 = off)"),
}
ROW_SUM_TOLERANCE = 1e-3  # validate=True: a probability row's sum may differ from 1 by this much (contract v1.3)
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _shape_text(shape) -> str:
    return "[" + ", ".join("*" if size is None else str(size) for size in shape) + "]"


def _dtype_text(dtypes) -> str:
    return " or ".join(str(dtype).replace("torch.", "") for dtype in dtypes)


def _matches(actual_shape, shape) -> bool:
    """Whether ``actual_shape`` fits ``shape``, whose ``None`` entries match any size."""
    if len(actual_shape) != len(shape):
        return False
    if shape.count(None) == len(shape):
        return True
    for actual, size in zip(actual_shape, shape):
        if size is not None and actual != size:
            return False
    return True


class Checker:
    """Checks the arguments of one op call; every message starts with the op name.

    The first tensor checked usually defines the sizes (``B``, ``K``, ``N``,
    ``V``, ...) the later ones are checked against; a shape mismatch names
    both arguments and both shapes (``tensor(..., sizes_from=)`` names
    another source).
    """

    def __init__(self, op_name: str, device: torch.device):
        self.op_name = op_name
        self.device = device
        self._checked = {}  # name -> (tensor, symbols) of every tensor checked so far
        self._first = None  # name of the first one: where the sizes come from by default

    def fail(self, message: str, error=ValueError):
        raise error(f"{self.op_name}: {message}")

    def tensor(self, name: str, value, shape, dtypes, symbols: str | None = None,
               sizes_from: str | None = None) -> torch.Tensor:
        """Check ``value`` is a tensor on the op's device with ``shape`` and a dtype in ``dtypes``.

        ``shape`` holds ints or ``None`` (any size); ``symbols`` names the
        dims (e.g. ``"[B, K+1, V]"``) so the message says what was expected.
        ``sizes_from`` names the checked argument the sizes came from (default:
        the first one checked); a mismatch quotes its shape too.
        """
        if not isinstance(value, torch.Tensor):
            self.fail(f"`{name}` must be a torch.Tensor; got {type(value).__name__}", TypeError)
        if value.dtype not in dtypes:
            self.fail(f"`{name}` must have dtype {_dtype_text(dtypes)}; got {_dtype_text([value.dtype])}", TypeError)
        # These checks run on every call: messages are built only on failure,
        # and a shape is compared in one C-level equality when it has no
        # wildcard, by its length when it has only wildcards (0.05 us each,
        # against 0.5 us for the loop over dims).
        actual_shape = value.shape
        if actual_shape != shape and not _matches(actual_shape, shape):
            expected = _shape_text(shape)
            described = f"{symbols} = {expected}" if symbols else expected
            message = f"`{name}` must have shape {described}; got {_shape_text(actual_shape)}"
            source = sizes_from or self._first
            if source is not None:
                source_tensor, source_symbols = self._checked[source]
                source_described = f"{source_symbols} = " if source_symbols else ""
                message += f", which disagrees with `{source}` of shape {source_described}" \
                           f"{_shape_text(source_tensor.shape)}"
            self.fail(message)
        if value.device != self.device:
            self.fail(f"`{name}` must be on {self.device} like the other tensors; got {value.device}")
        self._checked[name] = (value, symbols)
        if self._first is None:
            self._first = name
        return value

    def optional_tensor(self, name: str, value, shape, dtypes, symbols: str | None = None):
        return None if value is None else self.tensor(name, value, shape, dtypes, symbols)

    def temperature(self, value, batch_size: int):
        """``temperature``: ``None``, one real number for the batch, or a float32 tensor ``[B]``.

        Any real number is taken (a Python or numpy float or int) except NaN,
        which raises at once: as one number for the batch it is more likely a
        bug than a greedy marker (a NaN tensor entry is one, contract v1.3).
        Returns ``None`` or the float32 ``[B]`` tensor the ops take.
        """
        if value is None:
            return None
        if isinstance(value, torch.Tensor):
            return self.tensor("temperature", value, (batch_size,), (torch.float32,), "[B]")
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            self.fail(f"`temperature` must be a float32 tensor of shape [B] or a Python float; "
                      f"got {type(value).__name__}", TypeError)
        value = float(value)
        if math.isnan(value):
            self.fail("`temperature` must not be NaN as a Python number (use 0 or a negative value for greedy, "
                      "or a float32 tensor [B] whose NaN entries mark greedy requests)")
        return torch.full((batch_size,), value, dtype=torch.float32, device=self.device)

    def sampling_parameters(self, top_k, top_p, min_p, bonus_token_ids, batch_size: int):
        """``(top_k, top_p, min_p, bonus_token_ids)`` as the ops take them: int32, float32, float32, int32/int64 ``[B]``.

        Each is ``None``, a tensor ``[B]`` or one Python number for the
        batch; ``top_k`` and ``bonus_token_ids`` accept int32 or int64.
        """
        if top_k is None and top_p is None and min_p is None and bonus_token_ids is None:
            return None, None, None, None
        if top_k is not None and not isinstance(top_k, torch.Tensor):
            top_k = self._batch_scalar("top_k", top_k, batch_size, int, torch.int64)
        top_k = self.counts("top_k", top_k, batch_size)
        top_p = self._float_parameter("top_p", top_p, batch_size)
        min_p = self._float_parameter("min_p", min_p, batch_size)
        if bonus_token_ids is not None:
            if not isinstance(bonus_token_ids, torch.Tensor):
                self.fail(f"`bonus_token_ids` must be an int32 or int64 tensor of shape [B]; "
                          f"got {type(bonus_token_ids).__name__}", TypeError)
            self.tensor("bonus_token_ids", bonus_token_ids, (batch_size,), TOKEN_DTYPES, "[B]")
        return top_k, top_p, min_p, bonus_token_ids

    def _float_parameter(self, name: str, value, batch_size: int):
        if value is None or isinstance(value, torch.Tensor):
            return self.optional_tensor(name, value, (batch_size,), (torch.float32,), "[B]")
        return self._batch_scalar(name, value, batch_size, (int, float), torch.float32)

    def _batch_scalar(self, name: str, value, batch_size: int, kinds, dtype):
        """A Python number for the whole batch, as a ``[B]`` tensor; out of its range it raises at once (v1.3: a
        tensor entry out of range is "off" for its request, a number out of range is a caller's mistake)."""
        if isinstance(value, bool) or not isinstance(value, kinds):
            self.fail(f"`{name}` must be a tensor of shape [B] or a Python number; got {type(value).__name__}",
                      TypeError)
        in_range, text = _NUMBER_RANGES[name]
        if not in_range(value):
            self.fail(f"`{name}` must be {text}; got {value!r}")
        return torch.full((batch_size,), value, dtype=dtype, device=self.device)

    def sampling_parameter_values(self, top_k, top_p, min_p, bonus_token_ids, vocab_size: int) -> None:
        """``validate=True`` checks (synchronises): ``top_k >= 0``, ``top_p`` in ``(0, 1]``, ``min_p`` in ``[0, 1]``, bonus ids in ``[0, V)``."""
        rules = (
            ("top_k", top_k, lambda v: v >= 0, ">= 0 (0 = off)"),
            ("top_p", top_p, lambda v: (v > 0) & (v <= 1), "in (0, 1] (1 = off)"),
            ("min_p", min_p, lambda v: (v >= 0) & (v <= 1), "in [0, 1] (0 = off)"),
            ("bonus_token_ids", bonus_token_ids, lambda v: (v >= 0) & (v < vocab_size), f"in [0, V) = [0, {vocab_size})"),
        )
        for name, values, rule, text in rules:
            if values is None:
                continue
            bad = ~rule(values)
            if bool(bad.any()):
                request = int(bad.nonzero()[0, 0])
                self.fail(f"`{name}` must be {text}; request {request} has {values[request].item()}")

    def counts(self, name: str, value, batch_size: int):
        """A count tensor ``[B]`` (int32 or int64) as the int32 the ops take, or ``None``.

        int64 values are first clamped into int32's range, so a count the ops
        would clamp keeps that outcome.
        """
        if value is None:
            return None
        self.tensor(name, value, (batch_size,), TOKEN_DTYPES, "[B]")
        if value.dtype == torch.int32:
            return value
        return value.clamp(-(2**31), 2**31 - 1).to(torch.int32)

    def choice(self, name: str, value, choices):
        if value not in choices:
            self.fail(f"`{name}` must be one of {', '.join(map(repr, choices))}; got {value!r}")
        return value

    def random_state(self, batch_size: int, seed, offset):
        """Check ``seed`` (None, int or int64 ``[B]``) and ``offset`` (int or int64 ``[]``/``[B]``).

        An int is anything with ``__index__`` except a bool (so numpy integers
        count).
        """
        if type(offset) is int and (seed is None or type(seed) is int):  # the common case, on every call
            return
        if isinstance(seed, torch.Tensor):
            self.tensor("seed", seed, (batch_size,), (torch.int64,), "[B]")
        elif seed is not None and not _is_integer(seed):
            self.fail(f"`seed` must be None, an int or an int64 tensor of shape [B]; got {type(seed).__name__}",
                      TypeError)
        if isinstance(offset, torch.Tensor):
            if offset.dim() == 0:
                self.tensor("offset", offset, (), (torch.int64,), "[]")
            else:
                self.tensor("offset", offset, (batch_size,), (torch.int64,), "[B]")
        elif not _is_integer(offset):
            self.fail(
                f"`offset` must be an int or an int64 tensor of shape [] or [B]; got {type(offset).__name__}",
                TypeError,
            )

    def sampling_values(self, temperature, logits: bool, target, draft) -> None:
        """``validate=True`` checks of values (synchronises): temperatures and distributions.

        Temperatures must not be ``+inf`` (``0``, negatives and NaN are the
        contract's greedy markers, not errors). Probabilities must be finite
        and ``>= 0``; logits must not be NaN or ``+inf`` (``-inf`` masks a
        token). ``logits`` covers ``target`` only: ``draft`` (or None) is
        always probabilities (v1.3). Without ``validate`` such values have the outcomes written in
        ``docs/rng.md``.
        """
        if temperature is not None and bool((temperature == float("inf")).any()):
            self.fail("`temperature` must not be +inf (T > 0 samples; 0, a negative value or NaN means greedy)")
        for name, values, as_logits in (("target", target, logits), ("draft", draft, False)):
            if values is None:
                continue
            if as_logits:
                bad = torch.isnan(values) | (values == float("inf"))
                rule = "logits must not be NaN or +inf"
            else:
                bad = ~torch.isfinite(values) | (values < 0)
                rule = "probabilities must be finite and >= 0"
            if bool(bad.any()):
                where = [int(i) for i in bad.nonzero()[0]]
                self.fail(f"`{name}`: {rule}; element {where} is {float(values[tuple(where)])}")
            if not as_logits:
                self._row_sums(name, values)

    def _row_sums(self, name: str, values) -> None:
        """Probability rows must sum to 1 within ``ROW_SUM_TOLERANCE`` (v1.3), or within 4 ulps of 1 where the
        dtype's own rounding of a normalised row is coarser (float16, bfloat16). An all-zero ``draft`` row is no
        distribution, the contract's marker of a deterministic proposal: allowed."""
        if values.numel() == 0:
            return
        sums = values.double().sum(-1)
        tolerance = max(ROW_SUM_TOLERANCE, 4 * torch.finfo(values.dtype).eps)
        bad = (sums - 1).abs() > tolerance
        if name == "draft":
            bad &= sums != 0
        if bool(bad.any()):
            where = [int(i) for i in bad.nonzero()[0]]
            self.fail(f"`{name}`: probability rows must sum to 1 within {tolerance:g}; row {where} sums to "
                      f"{float(sums[tuple(where)]):.6g}")


def _is_integer(value) -> bool:
    if isinstance(value, int):  # under torch.compile, also a symbolic int
        return not isinstance(value, bool)
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def split_random_state(seed, offset):
    """``(seed_tensor, seed_int, offset_tensor, offset_int)`` for the op schemas.

    Ints wrap to signed 64 bits (the RNG reads two's complement), so any int
    is accepted, and graph capture bakes them in as constants. ``seed=None``
    stays ``None``: the op draws a fresh seed when it runs (:func:`fresh_seed`).
    """
    if type(offset) is int and _INT64_MIN <= offset <= _INT64_MAX:  # the common cases first: on every call
        if seed is None:
            return None, None, None, offset
        if type(seed) is int and _INT64_MIN <= seed <= _INT64_MAX:
            return None, seed, None, offset
    if isinstance(seed, torch.Tensor):
        seed_tensor, seed_int = seed, 0
    else:
        seed_tensor, seed_int = None, None if seed is None else _wrap_int64(seed)
    offset_tensor, offset_int = (offset, 0) if isinstance(offset, torch.Tensor) else (None, _wrap_int64(offset))
    return seed_tensor, seed_int, offset_tensor, offset_int


_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


def _wrap_int64(value) -> int:
    if not isinstance(value, int):  # a numpy integer
        value = operator.index(value)
    if _INT64_MIN <= value <= _INT64_MAX:
        return value
    value &= 0xFFFFFFFFFFFFFFFF
    return value - 2**64 if value >= 2**63 else value


# Seeds drawn for ``seed=None`` are 63-bit: [0, 2**63 - 1).
_FRESH_SEED_BOUND = 2**63 - 1
# One CPU scalar per thread receives the draws: ``random_`` into it costs
# 1.4 us against 2.4 us for ``torch.randint(...).item()``, and the explicit
# CPU device keeps the draw on the host under ``torch.set_default_device``.
_seed_buffers = threading.local()


def fresh_seed(op_name: str, device: torch.device) -> int:
    """A fresh seed from torch's default CPU generator, for a call with ``seed=None``.

    The draw is a host operation (``torch.manual_seed`` governs it, and no
    device is touched), made when the op runs, not when it is traced, so
    every call of a compiled graph draws anew. Under CUDA-graph capture the
    drawn value would be baked into the graph and repeat on every replay, so
    that raises; the capture state is queried only for CUDA tensors.
    """
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"{op_name}: seed=None draws a fresh seed on the host at every call, which a captured CUDA graph "
            "would replay unchanged; under CUDA-graph capture (also torch.compile(mode=\"reduce-overhead\")) "
            "pass `seed` as an int64 tensor [B] (or an int) and `offset` as an int64 tensor that you advance "
            "between replays"
        )
    buffer = getattr(_seed_buffers, "value", None)
    if buffer is None:
        buffer = _seed_buffers.value = torch.empty((), dtype=torch.int64, device="cpu")
    return buffer.random_(_FRESH_SEED_BOUND).item()


def device_seeds(shape, device, generator=None) -> torch.Tensor:
    """Fresh 63-bit int64 seeds drawn on ``device`` by ``generator`` (default: the device's own).

    The adapters' seeds, for engines that hand the op no seed: a device draw
    needs no host read, and under CUDA-graph capture torch advances the
    captured generator's offset at every replay, so each replay draws anew.
    """
    return torch.randint(_FRESH_SEED_BOUND, shape, dtype=torch.int64, device=device, generator=generator)


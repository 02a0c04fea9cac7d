"""What every verification op takes besides its layout, as one bundle from the schema to the kernels.

``chain_verify``, ``chain_verify_packed`` and ``tree_verify`` share the
sampling arguments (temperature, logits), the random state (seed and offset,
each a tensor or an int) and the sampling parameters (``top_k``, ``top_p``,
``min_p``, ``bonus_token_ids``). Their schemas spell them with the strings
below, and every backend receives them as one :class:`VerifyOptions`, so a
new option is added to the schemas, the bundle and each backend's one
reader of it, not to every signature on the way.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# The schema text of the bundle: the sampling head follows the op's layout arguments (tree_verify puts
# `draft_sampling` next), the tail ends every verification schema.
SCHEMA_SAMPLING = "Tensor? temperature=None, bool logits=False"
_SCHEMA_PARAMETERS = (
    "Tensor? seed_tensor=None, SymInt? seed=None, Tensor? offset_tensor=None, SymInt offset=0, Tensor? top_k=None, "
    "Tensor? top_p=None, Tensor? min_p=None, Tensor? bonus_token_ids=None"
)
SCHEMA_TAIL = f"{_SCHEMA_PARAMETERS}, str backend=\"auto\""
# The `.logprobs` overloads (one more output, the emitted tokens' log-probabilities) end with the kind asked for.
SCHEMA_TAIL_LOGPROBS = f"{_SCHEMA_PARAMETERS}, str logprobs=\"raw\", str backend=\"auto\""
LOGPROBS_KINDS = ("raw", "processed")


class VerifyOptions(NamedTuple):
    """The bundle, in schema order: an implementation gets ``VerifyOptions(*its schema's bundle arguments)``."""

    temperature: torch.Tensor | None
    logits: bool
    seed_tensor: torch.Tensor | None
    seed: int
    offset_tensor: torch.Tensor | None
    offset: int
    top_k: torch.Tensor | None = None
    top_p: torch.Tensor | None = None
    min_p: torch.Tensor | None = None
    bonus_token_ids: torch.Tensor | None = None
    logprobs: str | None = None  # only the `.logprobs` overloads pass it

    @property
    def truncates(self) -> bool:
        """Whether the call truncates its target rows: any of ``top_k``/``top_p``/``min_p`` given (the rule every
        launcher and plan choice reads; a request whose entries are all off is left untouched in the kernel)."""
        return self.top_k is not None or self.top_p is not None or self.min_p is not None

    @property
    def parameters(self) -> tuple:
        """``(top_k, top_p, min_p, bonus_token_ids)``."""
        return self.top_k, self.top_p, self.min_p, self.bonus_token_ids

    @property
    def random_state(self) -> tuple:
        """``(seed, offset)``, each the tensor when one was given, else the int (the references' arguments)."""
        return (self.seed if self.seed_tensor is None else self.seed_tensor,
                self.offset if self.offset_tensor is None else self.offset_tensor)

    def tensors_mapped(self, function) -> VerifyOptions:
        """The bundle with ``function`` applied to each tensor that is given (``None`` stays)."""
        return self._replace(**{name: function(getattr(self, name)) for name in _TENSORS
                                if getattr(self, name) is not None})


_TENSORS = ("temperature", "seed_tensor", "offset_tensor", "top_k", "top_p", "min_p", "bonus_token_ids")

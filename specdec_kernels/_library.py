"""The ``torch.ops.specdec`` namespace: every schema in one place.

``define`` + ``impl`` rather than ``@torch.library.custom_op``: the latter
adds Python wrapping on every call, and these ops run thousands of times per
second at decode time. Each op is implemented once for CPU and once for
CUDA by a dispatcher that runs the backend chosen on the host
(``_backend.resolve``), so ``backend=`` survives ``torch.compile`` as a plain
string argument. Seeds and offsets travel as an optional tensor plus an int:
a tensor is read by the kernel (fresh numbers on every CUDA-graph replay),
an int is a launch constant.

The ints are ``SymInt`` so that ``torch.compile`` keeps a stepping Python
``offset`` (or ``seed``) symbolic: an ``int`` schema argument specialises the
graph on its value, one recompilation per step. ``SymInt? seed=None`` means
"draw a fresh seed" (``_validation.fresh_seed``): the dispatcher draws it
when the op runs, so every op whose schema has that argument gets the
behaviour, and such ops carry the ``nondeterministic_seeded`` tag of
torch's random ops: the op consumes the global generator's state, so the
compiler must not fold, drop or recompute it (docs/rng.md).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.autograd.profiler

from . import _backend, _validation
from ._verify_options import SCHEMA_SAMPLING, SCHEMA_TAIL, SCHEMA_TAIL_LOGPROBS

NAMESPACE = "specdec"

# Defaults make direct calls work with the public functions' leading
# arguments, e.g. ``torch.ops.specdec.chain_verify(ids, target, draft, seed=3)``.
# The verification ops share their sampling arguments and tail (``_verify_options``).
SCHEMAS = {
    "chain_verify": (
        "chain_verify(Tensor draft_token_ids, Tensor target, Tensor? draft=None, Tensor? num_draft_tokens=None, "
        f"{SCHEMA_SAMPLING}, {SCHEMA_TAIL}) -> (Tensor, Tensor)"
    ),
    "chain_verify_packed": (
        "chain_verify_packed(Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target, Tensor? draft, "
        f"int max_num_draft_tokens, {SCHEMA_SAMPLING}, {SCHEMA_TAIL}) -> (Tensor, Tensor)"
    ),
    "tree_verify": (
        "tree_verify(Tensor tree_token_ids, Tensor parents, Tensor target, Tensor? draft=None, "
        f"Tensor? num_nodes=None, {SCHEMA_SAMPLING}, str draft_sampling=\"without_replacement\", {SCHEMA_TAIL}) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "build_tree": (
        "build_tree(Tensor parents, Tensor? num_nodes=None, Tensor? prefix_lens=None, str backend=\"auto\") "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "tree_attention": (
        "tree_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor tree_mask, Tensor? num_nodes=None, float? scale=None, str backend=\"auto\") -> Tensor"
    ),
    "compact_kv": (
        "compact_kv(Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor block_tables, Tensor prefix_lens, "
        "Tensor accepted_nodes, str backend=\"auto\") -> ()"
    ),
}

# Overloads of the verification ops for a feature that adds outputs: with `logprobs` (contract v1.3) one more,
# float32 the shape of the tokens. An overload registers only the backends that have its feature (`require`).
OVERLOAD_SCHEMAS = {
    "chain_verify.logprobs": (
        "chain_verify.logprobs(Tensor draft_token_ids, Tensor target, Tensor? draft=None, "
        f"Tensor? num_draft_tokens=None, {SCHEMA_SAMPLING}, {SCHEMA_TAIL_LOGPROBS}) -> (Tensor, Tensor, Tensor)"
    ),
    "chain_verify_packed.logprobs": (
        "chain_verify_packed.logprobs(Tensor draft_token_ids, Tensor cu_num_draft_tokens, Tensor target, "
        f"Tensor? draft, int max_num_draft_tokens, {SCHEMA_SAMPLING}, {SCHEMA_TAIL_LOGPROBS}) "
        "-> (Tensor, Tensor, Tensor)"
    ),
    "tree_verify.logprobs": (
        "tree_verify.logprobs(Tensor tree_token_ids, Tensor parents, Tensor target, Tensor? draft=None, "
        f"Tensor? num_nodes=None, {SCHEMA_SAMPLING}, str draft_sampling=\"without_replacement\", "
        f"{SCHEMA_TAIL_LOGPROBS}) -> (Tensor, Tensor, Tensor, Tensor)"
    ),
}


def _draws_seed(schema: str) -> bool:
    """Whether the op draws a seed when ``seed`` is None (its schema has ``SymInt? seed``)."""
    return any(argument.name == "seed" and isinstance(argument.type, torch.OptionalType)
               for argument in torch._C.parse_schema(schema).arguments)


_library = torch.library.Library(NAMESPACE, "DEF")
for _schema in (*SCHEMAS.values(), *OVERLOAD_SCHEMAS.values()):
    _library.define(_schema, tags=(torch.Tag.nondeterministic_seeded,) if _draws_seed(_schema) else ())

# The backends of each op, keyed by backend name (bench/bench_call_overhead.py
# swaps one for a stub to time everything but the kernel).
IMPLEMENTATIONS: dict[str, dict[str, Callable]] = {}
# The ops' default overloads: calling one skips the overload lookup that
# ``torch.ops.specdec.<op>(...)`` does on every call (about 0.6 us).
_OVERLOADS: dict[str, torch._ops.OpOverload] = {}
# Each op's dispatch function (``register``), which the overload runs.
_DISPATCHERS: dict[str, Callable] = {}


def require(op_name: str, backend: str) -> None:
    """Raise ``NotImplementedError`` when ``op_name`` (an op or ``op.overload``) has no ``backend`` yet.

    A feature lands one backend at a time (its overload registers the backends
    that have it): the error names the feature, the backend, and the backends
    that run it.
    """
    implementations = IMPLEMENTATIONS[op_name]
    if backend not in implementations:
        name, _, feature = op_name.partition(".")
        raise NotImplementedError(
            f"{name}: `{feature}` is not implemented on the {backend!r} backend yet; it runs on "
            f"{', '.join(repr(available) for available in implementations)} (pass backend=...)")


def register(op_name: str, implementations: dict[str, Callable], fake: Callable,
             auto_choice: Callable | None = None) -> None:
    """Register ``op_name``'s backends (keyed by backend name) and its fake.

    ``op_name`` is an op, or ``op.overload`` for an overload of it (a feature
    that adds outputs, e.g. ``chain_verify.logprobs``); an overload may
    register only the backends that have the feature (``require``).

    ``auto_choice(resolved, *arguments)``, when given, may change what
    ``"auto"`` resolved to from the device alone into another backend for
    these arguments (the public function applies the same).

    Every implementation takes all the schema's arguments except the
    trailing ``backend``. The public functions pass a resolved backend; a
    direct ``torch.ops.specdec`` call may omit trailing arguments (the
    dispatcher passes only those given) or say ``"auto"``. A ``seed`` of
    ``None`` is replaced here, when the op runs, by ``0`` next to a seed
    tensor or else by a fresh seed, so the implementations always get an int.
    """
    name, _, overload_name = op_name.partition(".")
    overload = getattr(getattr(torch.ops.specdec, name), overload_name or "default")
    _OVERLOADS[op_name] = overload
    IMPLEMENTATIONS[op_name] = implementations
    names = [argument.name for argument in overload._schema.arguments]
    defaults = [argument.default_value for argument in overload._schema.arguments]
    seed_index = names.index("seed") if "seed" in names else None
    seed_tensor_index = names.index("seed_tensor") if "seed_tensor" in names else None
    # A tensor that is never None gives the call's device.
    device_index = next(index for index, argument in enumerate(overload._schema.arguments)
                        if isinstance(argument.type, torch.TensorType))

    def dispatch(*args):
        # Kept lean: it runs on every call (the public functions pass every
        # argument and a resolved backend, so that is the first branch).
        *arguments, backend = args if len(args) == len(defaults) else (*args, *defaults[len(args):])
        implementation = implementations.get(backend)
        if implementation is None:
            resolved = _resolve_among(name, backend, arguments[device_index].device, implementations)
            if backend == "auto" and auto_choice is not None:
                resolved = auto_choice(resolved, *arguments)
            require(op_name, resolved)
            implementation = implementations[resolved]
        if seed_index is not None and arguments[seed_index] is None:
            arguments[seed_index] = (0 if arguments[seed_tensor_index] is not None
                                     else _validation.fresh_seed(name, arguments[device_index].device))
        return implementation(*arguments)

    _DISPATCHERS[op_name] = dispatch
    _library.impl(op_name, dispatch, "CPU")
    _library.impl(op_name, dispatch, "CUDA")
    torch.library.register_fake(f"{NAMESPACE}::{op_name}", lib=_library)(fake)


def op(op_name: str):
    """The registered op's default overload, ``torch.ops.specdec.<op_name>.default``."""
    return _OVERLOADS[op_name]


def _needs_torch_dispatcher(first_tensor) -> bool:
    """Whether a call must go through torch's dispatcher to be seen: tracing (``torch.compile``), a dispatch or
    torch-function mode (``FakeTensorMode``, ``torch.export``, ...), functorch transforms, the profiler (it records
    ops there) or a tensor subclass."""
    return (torch.compiler.is_compiling() or torch.autograd.profiler._is_profiler_enabled
            or type(first_tensor) is not torch.Tensor or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled() or torch._C._are_functorch_transforms_active())


def run(op_name: str, *args):
    """Run ``op_name`` on all its schema's arguments (the public functions' call).

    In plain eager mode the op's dispatch function is called directly: the
    same function the overload runs, without the torch dispatcher's boxing of
    a dozen arguments (about 4 us of a 10 us call). Whenever something must
    see the op (see ``_needs_torch_dispatcher``) the call goes through
    ``torch.ops.specdec.<op_name>``. Both give the same outputs.
    """
    if _needs_torch_dispatcher(args[0]):
        return _OVERLOADS[op_name](*args)
    return _DISPATCHERS[op_name](*args)


def verification_backend(op_name: str, logprobs: str | None, backend: str, device: torch.device) -> str:
    """The backend a verification op runs on (``_backend.resolve``): with ``logprobs``, ``"auto"`` chooses among
    the backends that have it."""
    overload = op_name if logprobs is None else f"{op_name}.logprobs"
    return _resolve_among(op_name, backend, device, IMPLEMENTATIONS[overload])


def _resolve_among(op_name: str, backend: str, device: torch.device, implemented) -> str:
    """``_backend.resolve``, where ``"auto"`` passes over a backend without an ``implemented`` entry (a feature
    that has not landed on every backend)."""
    resolved = _backend.resolve(op_name, backend, device)
    if backend == "auto" and resolved not in implemented:
        resolved = _backend.resolve(op_name, backend, device, implemented)
    return resolved


def run_verification(op_name: str, logprobs: str | None, *args):
    """``run(op_name, *args)`` of a verification op; with ``logprobs`` (``"raw"``/``"processed"``) its
    ``.logprobs`` overload instead, the kind passed before the backend (``args[-1]``, resolved), after
    ``require`` checked that the backend has it."""
    if logprobs is None:
        return run(op_name, *args)
    overload = f"{op_name}.logprobs"
    require(overload, args[-1])
    return run(overload, *args[:-1], logprobs, args[-1])


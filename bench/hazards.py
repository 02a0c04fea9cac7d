"""GPU hazard checks of the fused verification kernels, one check per process.

    python bench/hazards.py CHECK [--backends triton,cuda] [--fuzz-seconds S] [--dry-run]

Each check exercises a way a serving process can break a kernel that the
interpreter cannot show: CUDA-graph capture and replay, workspace growth after
a capture, graphs replayed out of order or at once, ``torch.compile(mode=
"reduce-overhead")``, a grid larger than the GPU while other work occupies it,
64-bit strides, tiny vocabularies, concurrent streams, a random bit-equality
fuzz, and the example's paged decoding loop end to end. ``bench/gpu_check.sh`` runs every check in its own process
under ``timeout``, so a hang is a failure, not a lost run. A check prints one
``PASS``/``FAIL`` line per backend (with its measurements; ``SKIP`` when it
cannot run, such as the decoding loop without ``transformers``) and exits
non-zero on any failure.

``--dry-run`` runs the same code on the CPU at tiny sizes (Triton under the
interpreter, the CUDA extension's host path): no hazard is exercised, but
``gpu_check.sh --dry-run`` in CI keeps the checks from rotting. There a
CUDA graph's capture is one eager call and its replay another (``capture``),
streams are the one CPU stream, and times are wall-clock.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import os
import random
import re
import statistics
import sys
import time

import torch

import specdec_kernels as sk
from specdec_kernels import _backend, _extension, _faults, _workspace
from specdec_kernels.launchers import chain_verify as chain_launchers
from specdec_kernels.launchers import tree_verify as tree_launchers

CHECKS = {}
OUTCOMES = {True: "PASS", False: "FAIL", None: "SKIP"}  # a check's ok: None when it cannot run here
# Buffers every call leaves at zero: counters, failure flags, claims, stage records.
COUNTER_NAME = re.compile(r"arrival|ticket|counter|failed|claim|stages")
DEVICE = "cuda"  # "cpu" under --dry-run
FUZZ_SECONDS = None  # --fuzz-seconds: the fuzz stops starting cases after this long (per backend)


def on_gpu() -> bool:
    return DEVICE == "cuda"


def size(gpu, dry_run):
    """A size of a check: ``gpu`` on the GPU, ``dry_run`` (tiny, for the CPU) under --dry-run."""
    return gpu if on_gpu() else dry_run


def synchronize():
    if on_gpu():
        torch.cuda.synchronize()


def capture(function, stream=None):
    """``(outputs, replay)``: ``function()`` captured in a CUDA graph (on ``stream``, default a side stream of
    torch's own), and the graph's replay.

    On the CPU (--dry-run) the capture is an eager call, and a replay calls
    ``function`` again and copies its outputs into the first ones, as a
    replay rewrites the captured outputs in place.
    """
    if not on_gpu():
        outputs = function()

        def replay():
            for captured, fresh in zip(flat(outputs), flat(function())):
                captured.copy_(fresh)

        return outputs, replay
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outputs = function()
    return outputs, graph.replay


def flat(outputs):
    if isinstance(outputs, torch.Tensor):
        return [outputs]
    return [tensor for output in outputs for tensor in flat(output)]


def side_stream():
    """A stream other than the current one; ``None`` on the CPU, where work runs in order anyway."""
    return torch.cuda.Stream() if on_gpu() else None


def on_stream(stream):
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def keep_busy():
    """Queues 20 bf16 8192x8192 products on a side stream, so that SMs stay busy while the check's kernel runs
    (nothing on the CPU)."""
    if not on_gpu():
        return
    stream = torch.cuda.Stream()
    a = torch.randn(8192, 8192, device=DEVICE, dtype=torch.bfloat16)
    stream.wait_stream(torch.cuda.current_stream())  # a is written on the current stream
    a.record_stream(stream)  # and freed below while the side stream may still read it
    with torch.cuda.stream(stream):
        for _ in range(20):
            a = a @ a.T * 1e-4


def run_cuda_on_the_host():
    """--dry-run: let ``backend="cuda"`` take CPU tensors, which the extension's ops run on its host path (the
    block programs on emulated blocks, as its tests call them); the public functions refuse them otherwise."""
    cuda_unavailable = _backend._WHY_UNAVAILABLE["cuda"]

    def unavailable(op_name, device):
        if device.type == "cpu" and _extension.extension_error() is None and op_name in _extension.extension_ops():
            return None
        return cuda_unavailable(op_name, device)

    _backend._WHY_UNAVAILABLE["cuda"] = unavailable


def check(function):
    CHECKS[function.__name__] = function
    return function


def problem(batch_size, max_drafts, vocab_size, *, logits=False, dtype=torch.float32, seed=0):
    """``(draft_token_ids, target, draft)``: drafts sampled from the draft, acceptance about 0.8."""
    device = DEVICE
    generator = torch.Generator(device).manual_seed(seed)
    x = 3 * torch.randn(batch_size, max_drafts + 1, vocab_size, generator=generator, device=device)
    y = x[:, :max_drafts] + 0.5 * torch.randn(batch_size, max_drafts, vocab_size, generator=generator, device=device)
    draft_probs = torch.softmax(y, -1)
    ids = torch.multinomial(draft_probs.reshape(-1, vocab_size), 1, generator=generator)
    ids = ids.view(batch_size, max_drafts).to(torch.int32)
    target = x if logits else torch.softmax(x, -1)  # the draft is probabilities either way (contract v1.3)
    return ids, target.to(dtype), draft_probs.to(dtype)


def counters_at_zero() -> bool:
    """Every counter and record of every workspace is back at zero (the next call relies on it), and no kernel
    counted a fault (a wait that gave up: ``sk.kernel_errors``)."""
    synchronize()
    clean = all(int(buffer.count_nonzero()) == 0 for key, buffer in _workspace._buffers.items()
                if COUNTER_NAME.search(key[0]))
    return clean and not any(sk.kernel_errors(DEVICE).values())


def same(expected, actual, logits=False) -> bool:
    if not logits:
        return all(torch.equal(e, a) for e, a in zip(expected, actual))
    rows = (expected[0] == actual[0]).all(-1) & (expected[1] == actual[1])
    return bool(rows.float().mean() >= 0.99)  # softmax rounding may differ between backends


def median_us(function, repeats=20) -> float:
    if not on_gpu():  # one wall-clock call: a dry run only runs the code
        start = time.perf_counter()
        function()
        return (time.perf_counter() - start) * 1e6
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        function()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


@check
def graph_replay(backend):
    """200 calls captured in one graph at B=1 (the decode-time case); replay time per call."""
    notes, ok = [], True
    calls = size(200, 1)
    for vocab_size in size((32000, 128256), (1500,)):
        for logits, dtype in ((False, torch.float32), (True, torch.bfloat16)):
            ids, target, draft = problem(1, 4, vocab_size, logits=logits, dtype=dtype)
            offset = torch.zeros((), dtype=torch.int64, device=DEVICE)
            call = lambda: sk.chain_verify(ids, target, draft, logits=logits, seed=5, offset=offset,  # noqa: E731
                                           backend=backend)
            sk.reserve_workspace(DEVICE, batch_size=1, max_draft_tokens=4, vocab_size=vocab_size, logits=logits)
            call()  # compiles outside capture
            outputs, replay = capture(lambda: [call() for _ in range(calls)])
            offset.fill_(7)
            replay()
            expected = sk.chain_verify(ids, target, draft, logits=logits, seed=5, offset=7, backend=backend)
            ok &= all(same(expected, output) for output in (outputs[0], outputs[-1])) and counters_at_zero()
            per_call = median_us(replay, 10) / calls
            notes.append(f"V={vocab_size} {'logits-bf16' if logits else 'probs-fp32'} {per_call:.2f} us/call")
    return ok, "; ".join(notes)


def copy_reference_us(num_bytes: int) -> float:
    """``torch.sum`` over ``num_bytes`` of float32: the read bandwidth the kernel is held against."""
    data = torch.ones(num_bytes // 4, device=DEVICE)
    data.sum()
    return median_us(lambda: data.sum())


@check
def throughput(backend):
    """B=256, K=4, V=128256: time against a torch.sum over the bytes the call needs."""
    notes, ok = [], True
    batch_size, vocab_size = size(256, 4), size(128256, 1500)
    for logits, dtype in ((False, torch.float32), (False, torch.bfloat16), (True, torch.bfloat16)):
        ids, target, draft = problem(batch_size, 4, vocab_size, logits=logits, dtype=dtype)
        call = lambda: sk.chain_verify(ids, target, draft, logits=logits, seed=1, offset=3,  # noqa: E731
                                       backend=backend)
        _, accepted = call()
        accepted = accepted.long()
        row_bytes = target.shape[-1] * target.element_size()
        # the stop row of p, and of q after a rejection; with logits every target row up to the stop (a softmax
        # reads its whole row; the draft is probabilities, read at its tokens)
        rows = (accepted + 1 if logits else 1) + (accepted < 4).long()
        needed = int(rows.sum()) * row_bytes
        kernel_us, sum_us = median_us(call), copy_reference_us(needed)
        ok &= counters_at_zero()
        notes.append(f"{'logits' if logits else 'probs'}-{str(dtype)[6:]} {kernel_us:.1f} us, "
                     f"{needed / kernel_us / 1e3:.0f} GB/s = {sum_us / kernel_us:.0%} of torch.sum")
    return ok, "; ".join(notes)


@check
def grow_after_capture(backend):
    """Capture at B=8, then an eager call at B=600 grows the workspace; the graph must still be right."""
    vocab_size = size(32000, 1500)
    ids, target, draft = problem(8, 4, vocab_size)
    offset = torch.zeros((), dtype=torch.int64, device=DEVICE)
    sk.reserve_workspace(DEVICE, batch_size=8, max_draft_tokens=4, vocab_size=vocab_size)
    sk.chain_verify(ids, target, draft, seed=2, offset=offset, backend=backend)
    captured, replay = capture(lambda: sk.chain_verify(ids, target, draft, seed=2, offset=offset, backend=backend))
    big = problem(size(600, 16), 4, vocab_size, seed=1)
    sk.chain_verify(*big, seed=2, offset=0, backend=backend)
    offset.fill_(9)
    replay()
    expected = sk.chain_verify(ids, target, draft, seed=2, offset=9, backend=backend)
    return same(expected, captured) and counters_at_zero(), "replay after growth"


@check
def graphs_out_of_order(backend):
    """Two graphs captured with plain torch.cuda.graph(g), replayed in the other order."""
    vocab_size = size(50000, 1500)
    problems = [problem(4, 3, vocab_size, seed=seed) for seed in (1, 2)]
    sk.reserve_workspace(DEVICE, batch_size=4, max_draft_tokens=3, vocab_size=vocab_size)
    replays, outputs = [], []
    for ids, target, draft in problems:
        sk.chain_verify(ids, target, draft, seed=3, offset=1, backend=backend)
        captured, replay = capture(
            lambda ids=ids, target=target, draft=draft: sk.chain_verify(ids, target, draft, seed=3, offset=1,
                                                                        backend=backend))
        outputs.append(captured)
        replays.append(replay)
    ok = True
    for index in (1, 0, 1):
        replays[index]()
        expected = sk.chain_verify(*problems[index], seed=3, offset=1, backend=backend)
        ok &= same(expected, outputs[index])
    return ok and counters_at_zero(), "replayed 1, 0, 1"


@check
def concurrent_graphs(backend):
    """Two graphs of the split plan, captured on two streams that each reserved a capture set of their own
    (sk.reserve_workspace(..., stream=, for_capture=True)), replayed at the same time on two other streams
    under a busy GPU: neither may count in the other's words."""
    vocab_size = size(50000, 1500)
    problems = [problem(4, 3, vocab_size, seed=seed) for seed in (5, 6)]
    capture_streams = [side_stream(), side_stream()]
    for stream in capture_streams:
        sk.reserve_workspace(DEVICE, batch_size=4, max_draft_tokens=3, vocab_size=vocab_size, stream=stream,
                             for_capture=True)
    replays, outputs = [], []
    for (ids, target, draft), stream in zip(problems, capture_streams):
        sk.chain_verify(ids, target, draft, seed=3, offset=1, backend=backend)  # compiled before the capture
        captured, replay = capture(
            lambda ids=ids, target=target, draft=draft: sk.chain_verify(ids, target, draft, seed=3, offset=1,
                                                                        backend=backend), stream)
        outputs.append(captured)
        replays.append(replay)
    expected = [sk.chain_verify(*inputs, seed=3, offset=1, backend="reference") for inputs in problems]
    replay_streams = [side_stream(), side_stream()]
    ok = True
    for _ in range(5):
        keep_busy()
        for replay, stream in zip(replays, replay_streams):
            if stream is not None:
                stream.wait_stream(torch.cuda.current_stream())  # the previous round's checks are done
            with on_stream(stream):
                replay()
        for stream in replay_streams:
            if stream is not None:
                torch.cuda.current_stream().wait_stream(stream)
        ok &= all(same(wanted, actual) for wanted, actual in zip(expected, outputs))
    splits = chain_plan(4, 3, vocab_size).num_splits
    return ok and counters_at_zero(), f"{splits} splits a request, 5 rounds of 2 graphs at once"


@check
def compile_reduce_overhead(backend):
    """torch.compile(mode="reduce-overhead") over changing batch sizes."""
    compiled = torch.compile(
        lambda ids, target, draft, offset: sk.chain_verify(ids, target, draft, seed=4, offset=offset, backend=backend),
        mode="reduce-overhead", dynamic=False)
    ok = True
    batch_sizes = size((1, 3, 8, 3, 17, 1, 8), (1, 3))
    for batch_size in batch_sizes:
        ids, target, draft = problem(batch_size, 4, size(32000, 1500), seed=batch_size)
        offset = torch.tensor(batch_size, dtype=torch.int64, device=DEVICE)
        for _ in range(2):
            actual = [t.clone() for t in compiled(ids, target, draft, offset)]
        expected = sk.chain_verify(ids, target, draft, seed=4, offset=offset, backend=backend)
        ok &= same(expected, actual)
    return ok and counters_at_zero(), "batch sizes " + ", ".join(map(str, batch_sizes))


def chain_plan(batch_size, max_drafts, vocab_size) -> chain_launchers.LaunchConfig:
    """The Triton launcher's untruncated configuration of a chain call on ``DEVICE`` (its own function)."""
    multiprocessors = chain_launchers._multiprocessor_count(torch.device(DEVICE)) if on_gpu() else None
    return chain_launchers.launch_config(batch_size, max_drafts + 1, vocab_size, multiprocessors)


# (B, K, V) of logits_busy_gpu: on a 132-SM H200, 3 vocabulary slices per row (tests/test_gpu_check.py).
LOGITS_BUSY_SHAPES = (128, 8, 128256)


@check
def logits_busy_gpu(backend):
    """Logits on the two-wave plan (several vocabulary slices per row: the second wave's programs wait for the
    first's statistics) while another stream keeps SMs busy: no program may wait on one never scheduled.

    B=128, K=8, V=128256 on a 132-SM H200: 3 slices per row, 2 x 128 x 3 = 768 Triton programs, about three
    times what is resident; the CUDA kernel's plan (2 blocks per SM) splits these rows in 3 as well."""
    batch_size, max_drafts, vocab_size = size(LOGITS_BUSY_SHAPES, (2, 3, 1500))
    config = chain_plan(batch_size, max_drafts, vocab_size)
    if config.num_splits < 2:  # one slice per row is the one-wave walk: nothing here would test the waits
        return False, f"the shapes take the one-wave walk plan ({config}), not the two-wave plan"
    row_blocks = -(-batch_size // config.rows)
    plan = (f"Triton plan: 2 waves x {row_blocks} row blocks x {config.num_splits} slices = "
            f"{2 * row_blocks * config.num_splits} programs")
    ids, target, draft = problem(batch_size, max_drafts, vocab_size, logits=True, dtype=torch.bfloat16)
    expected = sk.chain_verify(ids, target, draft, logits=True, seed=6, offset=0, backend=backend)
    keep_busy()
    actual = sk.chain_verify(ids, target, draft, logits=True, seed=6, offset=0, backend=backend)
    synchronize()
    return same(expected, actual, logits=True) and counters_at_zero(), f"{plan}; finished while a matmul stream ran"


def bushy_tree(batch_size, tree_size, vocab_size, seed):
    """``(ids, parents, target, draft)``: every node's parent among the first 4, tokens drawn from the parent's
    draft row, a sharp target: most children rejected, many stages at each node."""
    generator = torch.Generator(DEVICE).manual_seed(seed)
    parents = torch.tensor([-1] + [min(i - 1, i % 4) for i in range(1, tree_size)], device=DEVICE,
                           dtype=torch.int32).expand(batch_size, tree_size).contiguous()
    target = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator, device=DEVICE) * 4,
                           -1)
    draft = torch.softmax(torch.randn(batch_size, tree_size, vocab_size, generator=generator, device=DEVICE), -1)
    rows = draft[torch.arange(batch_size, device=DEVICE).view(-1, 1), parents.clamp_min(0).long()]
    ids = torch.multinomial(rows.view(-1, vocab_size), 1, generator=generator).view(batch_size, tree_size)
    return ids, parents, target, draft


@check
def tree_split_busy_gpu(backend):
    """tree_verify at B=2 (the split plan: about 66 programs per request share each pass) while another stream
    keeps SMs busy, then under graph replay with advancing offsets: the reference's bits, no hang."""
    tree_size, vocab_size = size(64, 8), size(128256, 1500)
    ids, parents, target, draft = bushy_tree(2, tree_size, vocab_size, seed=9)
    expected = [sk.tree_verify(ids, parents, target, draft, seed=3, offset=step, backend="reference")
                for step in range(4)]
    keep_busy()
    actual = sk.tree_verify(ids, parents, target, draft, seed=3, offset=0, backend=backend)
    synchronize()
    offset = torch.zeros((), dtype=torch.int64, device=DEVICE)
    sk.reserve_workspace(DEVICE, batch_size=2, max_draft_tokens=0, vocab_size=vocab_size, trees=True,
                         max_tree_nodes=tree_size)
    sk.tree_verify(ids, parents, target, draft, seed=3, offset=offset, backend=backend)  # compiles outside capture
    captured, replay = capture(
        lambda: sk.tree_verify(ids, parents, target, draft, seed=3, offset=offset, backend=backend))
    replayed = True
    for step in range(4):
        offset.fill_(step)
        replay()
        replayed &= same(expected[step], captured)
    accepted = float(expected[0][2].float().mean())
    return (same(expected[0], actual) and replayed and counters_at_zero(),
            f"mean accepted {accepted:.2f}; busy and 4 replays equal the reference")


@check
def forced_give_up(backend):
    """tree_verify's split plan at B=2, every root child rejected, with request 1's first program forced to give
    up its first wait (the tests' switch): on the GPU, request 1 gets the failure outcome, request 0 the
    reference's bits, one fault is counted, the workspace ends clean and the next call is the reference's."""
    vocab_size = size(128256, 3000)
    generator = torch.Generator(DEVICE).manual_seed(5)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 2, 3]] * 2, device=DEVICE)
    ids = torch.randint(0, vocab_size, (2, 7), generator=generator, device=DEVICE)
    target = torch.softmax(torch.randn(2, 7, vocab_size, generator=generator, device=DEVICE), -1)
    target[torch.arange(2, device=DEVICE).view(-1, 1), 0, ids[:, 1:4]] = 0.0  # every root child rejected
    draft = torch.softmax(torch.randn(2, 7, vocab_size, generator=generator, device=DEVICE), -1)
    expected = sk.tree_verify(ids, parents, target, draft, seed=2, backend="reference")
    multiprocessors = torch.cuda.get_device_properties(DEVICE).multi_processor_count if on_gpu() else None
    splits, _ = tree_launchers.vocabulary_splits(2, vocab_size, multiprocessors, 7)
    sk.kernel_errors(DEVICE)
    with _faults.forced_give_up(splits):  # request 1's rank 0
        failed = sk.tree_verify(ids, parents, target, draft, seed=2, backend=backend)
    outcome = (bool((failed[1][1] == -1).all()) and int(failed[2][1]) == 0
               and all(torch.equal(actual[0], wanted[0]) for actual, wanted in zip(failed, expected)))
    counted = sk.kernel_errors(DEVICE)["tree_verify.wait_gave_up"] == 1
    clean = counters_at_zero()
    again = same(expected, sk.tree_verify(ids, parents, target, draft, seed=2, backend=backend))
    return outcome and counted and clean and again, f"{splits} splits; outcome {outcome}, counted {counted}, " \
                                                    f"clean {clean}, next call {again}"


@check
def damaged_workspace(backend):
    """Every counter, flag, claim and record word of the stream's workspaces set to 1, a count in range (what a
    launch that never ended leaves), before a split chain call and a split tree call: on the GPU, with a
    request's programs running at once, the launches' claims reset the words first, so both calls give the
    clean calls' bits and count no fault, and the next calls too."""
    vocab_size = size(128256, 3000)
    ids, target, draft = problem(2, 4, vocab_size, seed=11)
    generator = torch.Generator(DEVICE).manual_seed(6)
    parents = torch.tensor([[-1, 0, 0, 0, 1, 2, 3]] * 2, device=DEVICE)
    tree_ids = torch.randint(0, vocab_size, (2, 7), generator=generator, device=DEVICE)
    tree_target = torch.softmax(torch.randn(2, 7, vocab_size, generator=generator, device=DEVICE), -1)
    tree_draft = torch.softmax(torch.randn(2, 7, vocab_size, generator=generator, device=DEVICE), -1)
    calls = [lambda: sk.chain_verify(ids, target, draft, seed=3, backend=backend),
             lambda: sk.tree_verify(tree_ids, parents, tree_target, tree_draft, seed=2, backend=backend)]
    clean = [call() for call in calls]  # they also create the buffers
    synchronize()
    damaged = [buffer for (name, _, device, stream), buffer in _workspace._buffers.items()
               if COUNTER_NAME.search(name) and device.type == torch.device(DEVICE).type and isinstance(stream, int)]
    for buffer in damaged:
        buffer.fill_(1)
    unchanged = all(same(expected, call()) for expected, call in zip(clean, calls))
    faults = sum(sk.kernel_errors(DEVICE).values())
    again = all(same(expected, call()) for expected, call in zip(clean, calls))
    for buffer in damaged:  # the words no call of this check uses keep the damage
        buffer.zero_()
    return unchanged and faults == 0 and again and counters_at_zero(), \
        f"{len(damaged)} buffers at 1: outputs unchanged {unchanged}, faults {faults}, next calls {again}"


@check
def stride_overflow(backend):
    """A transposed target whose row offset K * stride passes 2**31 elements."""
    # The stride of a position is B * V = 5.4e8 on the GPU (5.4 GB of bfloat16).
    batch_size, max_drafts, vocab_size = size(17000, 12), 4, size(32000, 300)
    generator = torch.Generator(DEVICE).manual_seed(7)
    planes = torch.rand(max_drafts + 1, batch_size, vocab_size, generator=generator, device=DEVICE,
                        dtype=torch.bfloat16)
    target = planes.transpose(0, 1)  # [B, K+1, V], stride(1) = B * V
    ids = torch.randint(0, vocab_size, (batch_size, max_drafts), generator=generator, device=DEVICE)
    seeds = torch.arange(batch_size, device=DEVICE)
    actual = sk.chain_verify(ids, target, None, seed=seeds, offset=1, backend=backend)
    tail = slice(batch_size - 8, batch_size)  # the requests whose rows lie past 2**31 elements
    expected = sk.chain_verify(ids[tail], target[tail], None, seed=seeds[tail], offset=1, backend="reference")
    stride = max_drafts * target.stride(1)
    return same(expected, [actual[0][tail], actual[1][tail]]) and counters_at_zero(), f"K*stride = {stride:.1e}"


@check
def small_vocabularies(backend):
    """V=1 and V=16 at B=1024, K=8 (row packing), probabilities and logits."""
    ok = True
    batch_size = size(1024, 16)
    for vocab_size in (1, 16):
        for logits in (False, True):
            ids, target, draft = problem(batch_size, 8, vocab_size, logits=logits, seed=vocab_size)
            arguments = dict(logits=logits, seed=torch.arange(batch_size, device=DEVICE), offset=2)
            expected = sk.chain_verify(ids, target, draft, backend="reference", **arguments)
            ok &= same(expected, sk.chain_verify(ids, target, draft, backend=backend, **arguments), logits)
    return ok and counters_at_zero(), "V in {1, 16}"


# (dtype, draft given, counts given, temperatures given, per-request seeds, tensor offset): a fixed set,
# so that the fuzz varies values (sizes, ids, counts, greedy mixes, seeds) rather than compiling
# hundreds of kernel specialisations.
FUZZ_STRUCTURES = (
    (torch.float32, True, False, False, False, False),
    (torch.float32, False, True, True, True, True),
    (torch.bfloat16, True, True, True, False, True),
    (torch.float16, True, True, False, True, False),
    (torch.bfloat16, False, False, True, True, True),
    (torch.float32, True, True, True, True, True),
)


@check
def fuzz(backend):
    """Random sizes, ids, counts, greedy mixes and seeds: bit equal to the reference, counters at zero.

    2000 cases, or as many as start within ``--fuzz-seconds`` (each new kernel specialisation compiles for
    seconds on a fresh machine, so a time-boxed run covers the first cases of the same sequence)."""
    rng = random.Random(8)
    failures = []
    cases = size(2000, 4)
    started = time.perf_counter()
    for case in range(cases):
        if FUZZ_SECONDS is not None and time.perf_counter() - started > FUZZ_SECONDS:
            cases = case
            break
        dtype, with_draft, with_counts, with_temperature, per_request, tensor_offset = rng.choice(FUZZ_STRUCTURES)
        batch_size, max_drafts = rng.randint(1, 40), rng.choice((3, 8))
        vocab_size = rng.choice(size((111, 5000, 32000), (111, 1500)))
        ids, target, draft = problem(batch_size, max_drafts, vocab_size, dtype=dtype, seed=case)
        ids[torch.rand(ids.shape, device=DEVICE) < 0.05] = -1
        arguments = dict(
            draft=draft if with_draft else None,
            num_draft_tokens=torch.randint(0, max_drafts + 1, (batch_size,), device=DEVICE, dtype=torch.int32)
            if with_counts else None,
            temperature=torch.where(torch.rand(batch_size, device=DEVICE) < 0.2, 0.0, 1.0)
            if with_temperature else None,
            seed=torch.randint(0, 2**62, (batch_size,), device=DEVICE) if per_request else rng.getrandbits(63),
            offset=torch.tensor(case, device=DEVICE) if tensor_offset else case,
        )
        expected = sk.chain_verify(ids, target, backend="reference", **arguments)
        actual = sk.chain_verify(ids, target, backend=backend, **arguments)
        if not same(expected, actual):
            failures.append(case)
    return (not failures and counters_at_zero(),
            f"{cases} cases in {time.perf_counter() - started:.0f} s, mismatches {failures[:10]}")


def load_paged_example():
    """``examples/paged_speculative.py`` as a module (it needs ``transformers``)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "examples", "paged_speculative.py")
    spec = importlib.util.spec_from_file_location("paged_speculative", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file runs
    spec.loader.exec_module(module)
    return module


@check
def paged_decoding(backend):
    """examples/paged_speculative.py's loop on this backend: paged cache, tree attention, verification, compaction.

    Greedy tokens equal transformers' ``generate`` in tree and chain mode (float32 models on CUDA, whose tree
    attention has a float32 program; float16 on Triton, whose attention takes 16-bit tensors), and tokens/s
    of the tree loop, plain paged decoding and ``generate`` in the same dtype (no kernel compiles twice).
    ``None`` (a skip) without ``transformers``, which the GPU image lacks."""
    try:
        example = load_paged_example()
    except ImportError as error:
        return None, f"{error}: install transformers (the GPU image has none) to run the decoding loop"
    batch_size, max_new_tokens = size(8, 2), size(64, 4)
    check_dtype = torch.float32 if backend == "cuda" else torch.float16
    target, draft = example.make_models(dtype=check_dtype, device=DEVICE)
    prompts = example.make_prompts(batch_size, 4, target.config.vocab_size, seed=0, device=DEVICE)
    differing = []
    for mode in ("tree", "chain"):
        tokens, _ = example.speculative_generate(target, draft, prompts, max_new_tokens, mode=mode, backend=backend)
        if not torch.equal(tokens, example.generate_plainly(target, prompts, max_new_tokens)):
            differing.append(mode)
    rates = example.benchmark(target, draft, prompts, max_new_tokens, dict(mode="tree", backend=backend))
    note = ", ".join(f"{name} {rate:.0f} tokens/s" for name, rate in rates.items())
    verdict = f"greedy tokens differ from generate in {differing}" if differing else "greedy tokens equal generate"
    return not differing, f"{verdict}; {str(check_dtype)[6:]}, B={batch_size}: {note}"


@check
def two_streams(backend):
    """Two streams calling at once: each has its own workspace and gets its own answer."""
    problems = [problem(16, 4, size(128256, 1500), seed=seed) for seed in (1, 2)]
    expected = [sk.chain_verify(*p, seed=9, offset=4, backend=backend) for p in problems]
    streams = [side_stream() for _ in problems]
    for stream in streams:  # the inputs were written on the current stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())
    # `problems` keeps the inputs alive until the synchronize below, so their memory cannot be reused while the
    # side streams read it (no record_stream needed); the outputs are allocated on the streams that write them.
    results = [[], []]
    for _ in range(size(50, 2)):
        for index, (stream, arguments) in enumerate(zip(streams, problems)):
            with on_stream(stream):
                results[index].append(sk.chain_verify(*arguments, seed=9, offset=4, backend=backend))
    synchronize()
    ok = all(same(expected[index], output) for index in (0, 1) for output in results[index])
    return ok and counters_at_zero(), f"{len(results[0])} calls on each of 2 streams"


def main(argv=None) -> int:
    global DEVICE, FUZZ_SECONDS
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("check", choices=sorted(CHECKS))
    parser.add_argument("--backends", default="triton,cuda")
    parser.add_argument("--fuzz-seconds", type=float, default=None,
                        help="fuzz: start no case after this many seconds per backend (default: all 2000)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU at tiny sizes, Triton under the interpreter (needs TRITON_INTERPRET=1)")
    args = parser.parse_args(argv)
    if args.dry_run and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--dry-run runs the Triton kernels under the interpreter: set TRITON_INTERPRET=1")
    DEVICE = "cpu" if args.dry_run else "cuda"
    if args.dry_run:
        run_cuda_on_the_host()
    FUZZ_SECONDS = args.fuzz_seconds
    status = 0
    for backend in args.backends.split(","):
        try:
            ok, note = CHECKS[args.check](backend)
        except Exception as error:  # reported as a failure of this check, then the next backend
            ok, note = False, f"{type(error).__name__}: {error}"
        print(f"{OUTCOMES[ok]} {args.check} {backend}: {note}", flush=True)
        status |= 1 if ok is False else 0
    return status


if __name__ == "__main__":
    sys.exit(main())

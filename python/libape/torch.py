"""APE attention as a differentiable PyTorch operation, and the seed's APEAttention module.

    import libape.torch as apet
    o = apet.attention(q, k, v, delta=d, beta=b, gamma=g, lam=l)   # autograd through libape
    layer = apet.APEAttention(num_heads=6, head_dim=64)            # learnable delta..lambda_
    o = layer(q, k, v)

On PyTorch 2.4 or later the operation is `torch.ops.libape.attention` (torch.library.custom_op,
with register_fake and register_autograd: torch.compile traces it without graph breaks, and
torch.library.opcheck passes); on older PyTorch, or with LIBAPE_TORCH_FALLBACK=1 in the
environment when this module is imported, it is a torch.autograd.Function. Both compute the
forward with ape_attention_forward() and every gradient (q, k, v and the four parameters) with
ape_attention_backward(). attention_varlen (ragged batches) is likewise
`torch.ops.libape.attention_varlen` or an autograd.Function, through
ape_attention_forward_varlen() and ape_attention_backward_varlen().

Distance-bias tables. `bias_table=` (a tensor [H, M] or [1, M]: every score of head h gets
T[h][min(|n|, M - 1)] added; docs/ape.md, "Distance-bias tables") is differentiable too: its
gradient comes from the host-array backward (ape_attention_backward(), or
ape_attention_backward_varlen(), with desc.dbias_table), CUDA tensors included (copied through
host memory: the backward on device tensors does not return a table's gradient).
`APEAttention(..., bias_table_len=M)` learns one beside its four parameters.

Devices. `device=None` (the default) runs the forward on the best device ("auto") when no
gradient is wanted. When any input or parameter requires a gradient, forward and backward run
on libape's OpenCL device if its backward pass runs there (probed once, with a tiny call;
devices without cl_khr_fp64 have one too, with compensated float32 sums), else on the
reference backend ("ref": float64, exact, and
tens of times slower; one forward and backward at H = 6, D = 64, L = 1024 took 6.7 s there
against 0.12 s on OpenCL on a 2-core Intel Xeon, bench/RESULTS.md). CUDA is used for CPU
tensors only when asked for: its backward has not yet run on a GPU (emulator only).
APE_BACKEND, when set and not "auto", names the device, as for any "auto" choice.
`libape.torch.grad_device()` says which device that is. With a bias_table and device=None (and
APE_BACKEND unset), a device whose capabilities lack "bias_table" is passed over for the most
preferred one that computes tables (and, with gradients, has a backward pass). A device given
explicitly is used for both passes: a backward on a device without one
raises libape.ApeError (APE_ENOTSUP) naming it; nothing falls back to another device.
CUDA tensors run on libape's CUDA device of the same ordinal, where they are, on PyTorch's
current stream (ape_attention_forward_dlpack()); so do their gradients
(ape_attention_backward_dlpack(): no copy through host memory). (No GPU has run these paths yet:
both are tested on CPU tensors through the same DLPack calls, and the C library's CUDA paths on
the emulator.)
"""
import os
from typing import Optional, Tuple

import torch

from . import _core
from ._core import SEED_BETA, SEED_DELTA, SEED_GAMMA, SEED_LAMBDA

__all__ = ["attention", "attention_varlen", "APEAttention", "IMPLEMENTATION", "grad_device",
           "TRAIN_SKIP_TOL", "omp_guard"]

_HAS_CUSTOM_OP = hasattr(torch, "library") and hasattr(torch.library, "custom_op") and \
    hasattr(torch.library, "register_autograd")
_FALLBACK = os.environ.get("LIBAPE_TORCH_FALLBACK", "") not in ("", "0") or not _HAS_CUSTOM_OP
#: "custom_op" (torch.ops.libape.attention, .attention_varlen) or "autograd.Function" (older
#: PyTorch, or forced).
IMPLEMENTATION = "autograd.Function" if _FALLBACK else "custom_op"


# ------------------------------------------------------------------ the two C calls on tensors

def _value(p):
    """A parameter tensor as libape takes it: a float (shape [], shared by all heads) or one
    float32 value per head (shape [H])."""
    if p.dim() == 0:
        return float(p)
    return p.detach().to(torch.float32).cpu().contiguous().numpy()


#: skip_tol of training (attention(skip_tol=None)): the library's default, 2^-24, in both passes.
TRAIN_SKIP_TOL = 2.0 ** -24


def _skip(skip_tol):
    return TRAIN_SKIP_TOL if skip_tol is None else float(skip_tol)


def _table(t):
    """A distance-bias table as libape reads it: None, or its values as a float32 CPU tensor
    (a table of another floating dtype, or on a GPU, is converted; its gradient is converted
    back by autograd)."""
    return None if t is None else t.detach().to(device="cpu", dtype=torch.float32).contiguous()


def _table_grad(got, table, home):
    """The table's gradient from a host-array backward's result (a fifth element, float32),
    on the table's device; an empty float32 tensor on `home` where not computed (as the fake
    op says)."""
    if len(got) > 4 and got[4] is not None:
        return got[4].to(table.device)
    return torch.empty(0, dtype=torch.float32, device=home)


def _forward(q, k, v, delta, beta, gamma, lam, causal, scale, rope_base, rope_scale, layout,
             q_start, k_start, device, skip_tol, bias_table=None):
    return _core.attention(q.detach(), k.detach(), v.detach(), delta=_value(delta),
                           beta=_value(beta), gamma=_value(gamma), lam=_value(lam),
                           causal=causal, scale=scale, rope_base=rope_base, layout=layout,
                           q_start=q_start, k_start=k_start, skip_tol=_skip(skip_tol),
                           device=device, return_lse=True, rope_scale=rope_scale,
                           bias_table=_table(bias_table))


def _backward(q, k, v, o, lse, do, dlse, delta, beta, gamma, lam, causal, scale, rope_base,
              rope_scale, layout, q_start, k_start, device, skip_tol, wrt, bias_table=None):
    """(dq, dk, dv, dparams [H, 4], dbias_table); an unwanted gradient is an empty tensor (a
    custom op returns tensors only). CUDA tensors: computed where they are by the CUDA device
    of their ordinal, on the current stream (ape_attention_backward_dlpack(); dparams then on
    q's device too); through host memory (copies both ways) with a libape that lacks it, or
    when the table's gradient is wanted (the host-array backward alone returns it)."""
    home = q.device
    if q.is_cuda:
        got = None
        if "bias_table" not in wrt:
            got = _core._attention_backward_cuda(
                q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), do.detach(),
                None if dlse is None else dlse.detach(), _value(delta), _value(beta),
                _value(gamma), _value(lam), causal, scale, rope_base, layout, q_start, k_start,
                wrt, device, rope_scale=rope_scale, skip_tol=_skip(skip_tol),
                bias_table=_table(bias_table))
        if got is not None:  # computed on the device, on the current stream
            out = tuple(q.new_empty(0) if g is None else g for g in got[:3])
            return out + (got[3] if got[3] is not None
                          else q.new_empty(0, dtype=torch.float32),  # as the fake op says
                          _table_grad((), bias_table, home))
        # through host memory
        q, k, v, o, lse, do = (x.detach().cpu() for x in (q, k, v, o, lse, do))
        dlse = None if dlse is None else dlse.detach().cpu()
        if device in (None, "auto"):
            device = "cuda:%d" % (home.index or 0)
    got = _core.attention_backward(
        q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), do.detach(),
        dlse=None if dlse is None else dlse.detach(), delta=_value(delta), beta=_value(beta),
        gamma=_value(gamma), lam=_value(lam), causal=causal, scale=scale, rope_base=rope_base,
        layout=layout, q_start=q_start, k_start=k_start, wrt=wrt, device=device,
        rope_scale=rope_scale, skip_tol=_skip(skip_tol), bias_table=_table(bias_table))
    out = tuple(q.new_empty(0) if g is None else g for g in got[:3])
    if home.type == "cuda":
        out = tuple(g.to(home) for g in out)
    return out + (got[3] if got[3] is not None else torch.empty(0),  # to each param's device
                  _table_grad(got, bias_table, home))


def _varlen_forward(q, k, v, delta, beta, gamma, lam, cu_q, cu_k, pos_q, pos_k, causal, scale,
                    rope_base, rope_scale, layout, device, skip_tol, bias_table=None):
    return _core.attention_varlen(
        q.detach(), k.detach(), v.detach(), cu_q, cu_k, positions_q=pos_q, positions_k=pos_k,
        delta=_value(delta), beta=_value(beta), gamma=_value(gamma), lam=_value(lam),
        causal=causal, scale=scale, rope_base=rope_base, layout=layout,
        skip_tol=_skip(skip_tol), device=device, return_lse=True, rope_scale=rope_scale,
        bias_table=_table(bias_table))


def _varlen_backward(q, k, v, o, lse, do, dlse, delta, beta, gamma, lam, cu_q, cu_k, pos_q,
                     pos_k, causal, scale, rope_base, rope_scale, layout, device, skip_tol, wrt,
                     bias_table=None):
    """(dq, dk, dv, dparams [H, 4], dbias_table) of a ragged batch
    (ape_attention_backward_varlen()), an unwanted gradient an empty tensor as _backward()
    gives it."""
    got = _core.attention_varlen_backward(
        q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), do.detach(), cu_q, cu_k,
        dlse=None if dlse is None else dlse.detach(), positions_q=pos_q, positions_k=pos_k,
        delta=_value(delta), beta=_value(beta), gamma=_value(gamma), lam=_value(lam),
        causal=causal, scale=scale, rope_base=rope_base, layout=layout, wrt=wrt, device=device,
        rope_scale=rope_scale, skip_tol=_skip(skip_tol), bias_table=_table(bias_table))
    out = tuple(q.new_empty(0) if g is None else g for g in got[:3])
    return out + (got[3] if got[3] is not None else torch.empty(0),
                  _table_grad(got, bias_table, q.device))


# ------------------------------------------------------------------ what both operations share
#
# Each operation's inputs are (q, k, v, delta, beta, gamma, lam), then `n_extra` tensors (the
# ragged batch's cu_seqlens_q, cu_seqlens_k, positions_q, positions_k; none for the dense one),
# then its plain arguments, and last the distance-bias table (None: none; last, so that calls
# written before it existed still work); its outputs (o, lse). The backward call takes (q, k,
# v, o, lse, do, dlse, the four parameters, the extra tensors, the plain arguments, wrt, the
# table) and returns (dq, dk, dv, dparams, dbias_table).

def _wrt(needs):
    """The `wrt` of attention_backward from ctx.needs_input_grad over (q, k, v, delta, beta,
    gamma, lam, ..., bias_table)."""
    w = tuple(n for n, need in zip(("q", "k", "v"), needs[:3]) if need)
    w = w + ("params",) if any(needs[3:7]) else w
    return w + ("bias_table",) if needs[-1] else w


def _param_grads(dparams, params, needs):
    """The gradient of each parameter tensor from dparams [H, 4]: per head its column, for a
    shared (shape []) parameter the column's sum; None where not needed."""
    out = []
    for i, (p, need) in enumerate(zip(params, needs)):
        if not need:
            out.append(None)
            continue
        g = dparams[:, i].sum() if p.dim() == 0 else dparams[:, i]
        if g.dtype != p.dtype or g.device != p.device:
            g = g.to(device=p.device, dtype=p.dtype)
        out.append(g)
    return out


def _snapshot(*params):
    """The parameters' values as the forward used them (tiny copies: APEAttention projects
    lambda_ in place on its next call, which must not disturb a pending backward)."""
    return tuple(p.detach().clone() for p in params)


def _save(ctx, inputs, output, n_extra):
    """What the backward needs: the inputs, O and LSE, the parameters as the forward used them,
    the extra tensors (saved as tensors), the plain arguments, the table."""
    q, k, v, delta, beta, gamma, lam = inputs[:7]
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, *_snapshot(delta, beta, gamma, lam),
                          *inputs[7:7 + n_extra], inputs[-1])
    ctx.args = tuple(inputs[7 + n_extra:-1])
    # an output the loss does not use (LSE, mostly) reaches the backward as None, not as a
    # tensor of zeros: no zero dLSE to allocate, fill and hand to the C call
    ctx.set_materialize_grads(False)


def _grads(ctx, bwd, do, dlse, n_extra):
    """The gradient of every input from the backward call `bwd` (wrt a tuple of names); None
    for what needs none and for the extra tensors and plain arguments. do and dlse are None
    for an output the loss does not use (_save: grads not materialised): dlse None is the C
    call's "zeros"; do None (a loss of LSE alone) becomes zeros."""
    q, k, v, o, lse, *rest = ctx.saved_tensors
    params, extra, table = rest[:4], rest[4:4 + n_extra], rest[4 + n_extra]
    needs = ctx.needs_input_grad
    wrt = _wrt(needs)
    if not wrt or (do is None and dlse is None):
        return (None,) * len(needs)
    do = torch.zeros_like(o) if do is None else do.contiguous()
    dq, dk, dv, dp, db = bwd(q, k, v, o, lse, do, dlse, *params, *extra, *ctx.args, wrt,
                             table)
    grads = [g if need else None for g, need in zip((dq, dk, dv), needs[:3])]
    dtable = db.to(dtype=table.dtype) if needs[-1] else None
    return tuple(grads) + tuple(_param_grads(dp, params, needs[3:7])) + \
        (None,) * (len(needs) - 8) + (dtable,)


def _forward_fake(q, *args, **kwargs):
    """O like q, LSE float32 of q's shape without D ([B, H, Lq]; [total_q, H] packed)."""
    return q.new_empty(q.shape), q.new_empty(q.shape[:-1], dtype=torch.float32)


def _backward_fake(q, k, *args):
    """dq like q, dk and dv like k, dparams [H, 4] (H = q.shape[1], dense or packed), dbias
    float32 like the table (the last argument), each empty where `wrt` (the one before it)
    does not name it."""
    wrt, table = args[-2].split(","), args[-1]

    def like(x, name):
        return x.new_empty(x.shape, dtype=q.dtype) if name in wrt else q.new_empty(0)
    dp = q.new_empty((q.shape[1], 4) if "params" in wrt else (0,), dtype=torch.float32)
    db = table.new_empty(table.shape, dtype=torch.float32) if "bias_table" in wrt else \
        q.new_empty(0, dtype=torch.float32)
    return like(q, "q"), like(k, "k"), like(k, "v"), dp, db


def _register_autograd(op, bwd_op, n_extra):
    """op's autograd through the custom op bwd_op (wrt passed as "q,k,v,params,bias_table")."""
    def bwd(*args):
        return bwd_op(*args[:-2], ",".join(args[-2]), args[-1])

    op.register_autograd(lambda ctx, do, dlse: _grads(ctx, bwd, do, dlse, n_extra),
                         setup_context=lambda ctx, inputs, output:
                         _save(ctx, inputs, output, n_extra))


def _function(fwd, bwd, n_extra, doc):
    """The operation as a torch.autograd.Function (the fallback): fwd on the inputs, bwd for
    the gradients."""
    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *inputs):
            out = fwd(*inputs)
            _save(ctx, inputs, out, n_extra)
            return out

        @staticmethod
        @torch.autograd.function.once_differentiable  # as the custom op: no double backward
        def backward(ctx, do, dlse):
            return _grads(ctx, bwd, do, dlse, n_extra)
    Function.__doc__ = doc
    return Function


# ------------------------------------------------------------------ custom_op (PyTorch >= 2.4)

if not _FALLBACK:
    @torch.library.custom_op("libape::attention", mutates_args=())
    def _op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor,
            beta: torch.Tensor, gamma: torch.Tensor, lam: torch.Tensor, causal: bool,
            scale: Optional[float], rope_base: float, rope_scale: float, layout: str,
            q_start: Optional[int], k_start: int, device: str, skip_tol: Optional[float],
            bias_table: Optional[torch.Tensor] = None) -> Tuple[torch.Tensor, torch.Tensor]:
        return _forward(q, k, v, delta, beta, gamma, lam, causal, scale, rope_base, rope_scale,
                        layout, q_start, k_start, device, skip_tol, bias_table)

    _op.register_fake(_forward_fake)

    @torch.library.custom_op("libape::attention_backward", mutates_args=())
    def _op_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                lse: torch.Tensor, do: torch.Tensor, dlse: Optional[torch.Tensor],
                delta: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor, lam: torch.Tensor,
                causal: bool, scale: Optional[float], rope_base: float, rope_scale: float,
                layout: str, q_start: Optional[int], k_start: int, device: str,
                skip_tol: Optional[float], wrt: str, bias_table: Optional[torch.Tensor]
                ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        return _backward(q, k, v, o, lse, do, dlse, delta, beta, gamma, lam, causal, scale,
                         rope_base, rope_scale, layout, q_start, k_start, device, skip_tol,
                         tuple(wrt.split(",")), bias_table)

    _op_bwd.register_fake(_backward_fake)
    _register_autograd(_op, _op_bwd, 0)

    @torch.library.custom_op("libape::attention_varlen", mutates_args=())
    def _op_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, delta: torch.Tensor,
                   beta: torch.Tensor, gamma: torch.Tensor, lam: torch.Tensor,
                   cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor,
                   positions_q: Optional[torch.Tensor], positions_k: Optional[torch.Tensor],
                   causal: bool, scale: Optional[float], rope_base: float, rope_scale: float,
                   layout: str, device: str, skip_tol: Optional[float],
                   bias_table: Optional[torch.Tensor] = None
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
        return _varlen_forward(q, k, v, delta, beta, gamma, lam, cu_seqlens_q, cu_seqlens_k,
                               positions_q, positions_k, causal, scale, rope_base, rope_scale,
                               layout, device, skip_tol, bias_table)

    _op_varlen.register_fake(_forward_fake)

    @torch.library.custom_op("libape::attention_varlen_backward", mutates_args=())
    def _op_varlen_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
                       lse: torch.Tensor, do: torch.Tensor, dlse: Optional[torch.Tensor],
                       delta: torch.Tensor, beta: torch.Tensor, gamma: torch.Tensor,
                       lam: torch.Tensor, cu_seqlens_q: torch.Tensor,
                       cu_seqlens_k: torch.Tensor, positions_q: Optional[torch.Tensor],
                       positions_k: Optional[torch.Tensor], causal: bool,
                       scale: Optional[float], rope_base: float, rope_scale: float,
                       layout: str, device: str, skip_tol: Optional[float], wrt: str,
                       bias_table: Optional[torch.Tensor]
                       ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                  torch.Tensor]:
        return _varlen_backward(q, k, v, o, lse, do, dlse, delta, beta, gamma, lam,
                                cu_seqlens_q, cu_seqlens_k, positions_q, positions_k, causal,
                                scale, rope_base, rope_scale, layout, device, skip_tol,
                                tuple(wrt.split(",")), bias_table)

    _op_varlen_bwd.register_fake(_backward_fake)
    _register_autograd(_op_varlen, _op_varlen_bwd, 4)


# ------------------------------------------------------------------ autograd.Function (fallback)

_Function = _function(_forward, _backward, 0,
                      "attention for PyTorch before 2.4 (no torch.compile support).")
_VarlenFunction = _function(_varlen_forward, _varlen_backward, 4,
                            "attention_varlen for PyTorch before 2.4 (no torch.compile support).")


# ------------------------------------------------------------------ PyTorch's OpenMP threads
#
# PyTorch runs its CPU ops on libgomp's OpenMP threads, and libgomp keeps a thread that has
# finished a parallel region busy-waiting for the next one before it sleeps: GOMP_SPINCOUNT,
# 300000 PAUSE instructions when OMP_WAIT_POLICY is not set, 10-20 ms on a recent Xeon (PAUSE
# takes about 140 cycles there). A libape call on the CPU right after a torch op (the backward,
# right after the loss's gradient) then shares the cores with those spinning threads: PoCL's
# worker threads get half a core where one spins, and the call takes 1.3-2x as long (docs/
# python.md, "PyTorch's OpenMP threads"). libgomp reads its policy from the environment once,
# when torch loads it, but it cuts every spin to its "throttled" count (100 PAUSEs) while it
# manages more threads than the process may use CPUs; one more OpenMP thread pool makes it so:
# a helper thread that runs one parallel torch op (libgomp gives each thread that starts a
# parallel region a pool of its own) and then sleeps until stopped. Its pool's thread sleeps
# too. torch's own parallel regions then wake their threads with a futex (tens of
# microseconds), as with OMP_WAIT_POLICY=passive. That wake-up is what the guard costs
# PyTorch's own ops, and it can outweigh what it saves: measured on a quiet 2-core Xeon
# (bench/RESULTS.md, 2026-12-06), a libape backward beside spinning threads took 1.12x its time
# alone (1.01x with the guard), but a loop of small PyTorch ops ran 2.5x slower with the guard
# and a two-block model's training step no faster (6% slower at L = 256); on a machine shared
# with other work spinning threads cost far more (4.6x) and the guard pays. So it is opt-in:
# LIBAPE_TORCH_OMP_GUARD=1 (at the first call on CPU tensors) or omp_guard(True).

_OMP_GUARD = None   # None: not decided yet; False: not wanted here; else (thread, stop event)
_OMP_GUARD_LOCK = __import__("threading").Lock()


def _omp_guard_wanted():
    """Why the guard cannot or must not run (a string), or None: it may. Not with
    LIBAPE_TORCH_OMP_GUARD=0, where the user chose libgomp's policy (OMP_WAIT_POLICY,
    GOMP_SPINCOUNT), where torch's parallel backend is not OpenMP, or its OpenMP is not
    libgomp (LLVM's and Intel's libomp spin for KMP_BLOCKTIME instead: set it to 0)."""
    if os.environ.get("LIBAPE_TORCH_OMP_GUARD", "1") == "0":
        return "LIBAPE_TORCH_OMP_GUARD=0"
    for env in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        if os.environ.get(env):
            return "%s is set" % env
    if "OpenMP" not in torch.__config__.parallel_info():
        return "torch's parallel backend is not OpenMP"
    try:
        with open("/proc/self/maps") as maps:
            if not any("libgomp" in line for line in maps):
                return "torch's OpenMP runtime is not libgomp"
    except OSError:
        return "no /proc/self/maps: cannot tell torch's OpenMP runtime"
    return None


def _omp_keeper(ready, stop):
    # a parallel region from this thread (more elements than at::parallel_for's grain, 32768):
    # libgomp gives the thread its own pool, which it counts until the thread ends
    torch.ones(1 << 17).mul_(2.0)
    ready.set()
    stop.wait()


def omp_guard(enable=None):
    """Whether the guard against PyTorch's spinning OpenMP threads is on (see above and
    docs/python.md). Off unless asked for: with LIBAPE_TORCH_OMP_GUARD=1, libape.torch turns
    it on at its first call on CPU tensors made while torch uses more than one thread, through
    libgomp, unless _omp_guard_wanted() says otherwise. enable=True turns it on now (where it
    may run), False off for good (the helper thread ends, libgomp frees its pool and spins
    again); None only asks."""
    global _OMP_GUARD
    with _OMP_GUARD_LOCK:
        if enable is False:
            if _OMP_GUARD:
                thread, stop = _OMP_GUARD
                stop.set()
                thread.join()
            _OMP_GUARD = False
        elif enable and not _OMP_GUARD:
            if _omp_guard_wanted() is None:
                import threading
                ready, stop = threading.Event(), threading.Event()
                thread = threading.Thread(target=_omp_keeper, args=(ready, stop),
                                          name="libape-omp-guard", daemon=True)
                thread.start()
                ready.wait()
                _OMP_GUARD = (thread, stop)
            else:
                _OMP_GUARD = False
        return bool(_OMP_GUARD)


def _compiling():
    """Whether dynamo is tracing the call (never on a PyTorch without torch.compiler)."""
    return hasattr(torch, "compiler") and hasattr(torch.compiler, "is_compiling") and \
        torch.compiler.is_compiling()


def _omp_check(q):
    """The guard at a call on CPU tensors, decided once torch uses more than one thread: on
    where LIBAPE_TORCH_OMP_GUARD=1 asks for it."""
    if _OMP_GUARD is None and os.environ.get("LIBAPE_TORCH_OMP_GUARD") == "1" and \
            not _compiling() and not q.is_cuda and torch.get_num_threads() > 1:
        omp_guard(True)


# ------------------------------------------------------------------ which of the two runs a call

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _use_function(tensors):
    """Whether a call runs through the autograd.Function rather than the custom op: always on
    the fallback; else in plain eager mode. The custom op's Python dispatch (schema defaults,
    the dynamo-disabled wrappers, its own autograd node) cost 0.2-0.3 ms a forward and as much
    a backward, more than the C calls themselves at small sizes (python/examples/
    fine_tune_ape.py), and both run the same _forward, _backward, _save and _grads. The custom
    op stays where PyTorch needs an operator: torch.compile and torch.export (dynamo), tracing
    (torch.jit.trace, make_fx), dispatch modes (FakeTensorMode, ...), functorch transforms and
    tensor subclasses."""
    if _FALLBACK:
        return True
    if torch.compiler.is_compiling() or torch.jit.is_tracing() or \
            torch._C._are_functorch_transforms_active() or \
            torch._C._len_torch_dispatch_stack() or _dispatch_mode():
        return False
    return all(t is None or type(t) in _PLAIN for t in tensors)


try:
    from torch.utils._python_dispatch import is_in_torch_dispatch_mode as _dispatch_mode
except ImportError:  # a PyTorch without it: take the custom op, which works everywhere
    def _dispatch_mode():
        return True


# ------------------------------------------------------------------ the public function

_consts = {}


def _as_param(x):
    """A parameter as a tensor: tensors as they are; floats as cached scalar tensors (never
    handed out, so never changed); sequences as a new [H] tensor."""
    if isinstance(x, torch.Tensor):
        return x
    if type(x) in (int, float):
        t = _consts.get(x)
        if t is None:
            if len(_consts) > 256:
                _consts.clear()
            t = _consts[x] = torch.tensor(float(x), dtype=torch.float32)
        return t
    return torch.tensor(x, dtype=torch.float32)


def _as_table(t):
    """A distance-bias table as an operation's input: None, or a floating tensor (NumPy arrays
    and sequences become float32 tensors; other tensors are refused naming bias_table)."""
    if t is None:
        return None
    if not isinstance(t, torch.Tensor):
        t = torch.as_tensor(t, dtype=torch.float32)
    if not t.is_floating_point():
        _core._bad("bias_table: dtype %s: must be a floating dtype (float32)" % t.dtype)
    return t


_GRAD_DEVICE = None


# torch.compile runs it once, eagerly, and takes its answer as a constant: its probe (a tiny C
# call through NumPy and ctypes) cannot be traced, and a process's first call may well be a
# compiled one (a PyTorch without torch.compiler compiles nothing)
@getattr(getattr(torch, "compiler", None), "assume_constant_result", lambda f: f)
def grad_device():
    """The device that runs a call with gradients when none is given (see the module's doc):
    "opencl" when libape's OpenCL device runs the backward pass (probed once, with a tiny
    forward and backward), "auto" when APE_BACKEND names a backend, else "ref"."""
    global _GRAD_DEVICE
    if _GRAD_DEVICE is None:
        env = os.environ.get("APE_BACKEND", "")
        if env not in ("", "auto"):
            _GRAD_DEVICE = "auto"
        else:
            import numpy as np
            q = np.linspace(-1, 1, 24, dtype=np.float32).reshape(1, 1, 3, 8)
            try:
                o, lse = _core.attention(q, q, q, device="opencl", return_lse=True)
                _core.attention_backward(q, q, q, o, lse, q, device="opencl")
                _GRAD_DEVICE = "opencl"
            except (_core.ApeError, ValueError):  # no OpenCL, or no backward there
                _GRAD_DEVICE = "ref"
    return _GRAD_DEVICE


_TABLE_DEVICE = {}


def _table_device(spec, training):
    """spec, or, where the device it names states no "bias_table" capability and the choice is
    this module's own (APE_BACKEND unset or "auto"), the most preferred device that does (and
    has "backward" when training)."""
    key = (spec, training)
    got = _TABLE_DEVICE.get(key)
    if got is None:
        got = spec
        need = {"bias_table", "backward"} if training else {"bias_table"}
        if os.environ.get("APE_BACKEND", "auto") in ("", "auto") and not need <= set(
                _core._capabilities(_core._device_spec(spec))):
            got = next((d["spec"] for d in _core.devices() if need <= set(d["capabilities"])),
                       spec)
        _TABLE_DEVICE[key] = got
    return got


def _pick_device(device, tensors, table=None):
    if device is not None:
        return device
    if tensors[0].is_cuda:
        return "auto"  # the CUDA device of q's ordinal (libape._core._attention_cuda)
    training = torch.is_grad_enabled() and any(
        t.requires_grad for t in tensors + ((table,) if table is not None else ()))
    spec = grad_device() if training else "auto"
    return spec if table is None else _table_device(spec, training)


def attention(q, k, v, *, delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA, lam=SEED_LAMBDA,
              causal=True, scale=None, rope_base=10000.0, layout="half", q_start=None,
              k_start=0, device=None, return_lse=False, rope_scale=1.0, skip_tol=None,
              bias_table=None):
    """APE attention of torch CPU tensors q `[B, H, Lq, D]`, k, v `[B, Hkv, Lk, D]`, returning O
    (and LSE `[B, H, Lq]` float32 with return_lse=True), differentiable with respect to q, k, v,
    the parameters and the bias_table. Parameters are floats, scalar tensors (shared by all heads:
    their gradient is the sum over heads) or tensors of shape [H] (one per head). `device=None`:
    "auto" without gradients, grad_device() with (see the module's doc); an explicit device is used
    for both passes. skip_tol (None: TRAIN_SKIP_TOL, 2^-24, the library's default) is used in both
    passes: keys the skip bounds prove to carry at most that share of a row's weight (the forward)
    or of each gradient (the backward) are left out, so that long contexts under decay train at the
    cost of the keys within reach; 0 computes every pair (the gradients of the exact function).
    rope_scale: position interpolation (libape.attention's; not differentiated). bias_table: None,
    or a distance-bias table, a tensor `[H, M]` (a row per head) or `[1, M]` (shared by every
    head), float32 or another floating dtype (computed in float32), on any device: every score of
    head h gets bias_table[h][min(|n|, M - 1)] added (libape.attention's); its gradient has its
    shape (summed over the heads for `[1, M]`)."""
    params = [_as_param(x) for x in (delta, beta, gamma, lam)]
    table = _as_table(bias_table)
    dev = _pick_device(device, (q, k, v, *params), table)
    _omp_check(q)
    args = (q, k, v, *params, bool(causal), None if scale is None else float(scale),
            float(rope_base), float(rope_scale), layout,
            None if q_start is None else int(q_start), int(k_start), dev,
            None if skip_tol is None else float(skip_tol), table)
    o, lse = _Function.apply(*args) if _use_function(args[:7] + (table,)) else _op(*args)
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------ ragged batches

def _index_tensor(x):
    """cu_seqlens or positions as a tensor (an op takes tensors only): tensors as they are,
    NumPy arrays shared, sequences copied; None stays None (the default positions)."""
    if x is None or isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, positions_q=None, positions_k=None,
                     delta=SEED_DELTA, beta=SEED_BETA, gamma=SEED_GAMMA, lam=SEED_LAMBDA,
                     causal=True, scale=None, rope_base=10000.0, layout="half", device=None,
                     return_lse=False, rope_scale=1.0, skip_tol=None, bias_table=None):
    """libape.attention_varlen on torch CPU tensors (q `[total_q, H, D]`, k, v
    `[total_k, Hkv, D]`, cu_seqlens int32 or int64, positions int64), differentiable with
    respect to q, k, v, the parameters and the bias_table: `torch.ops.libape.attention_varlen`
    where IMPLEMENTATION is "custom_op" (torch.compile traces it without graph breaks), else an
    autograd.Function. Strided views (slices of a packed QKV tensor) go without a copy.
    `device`, rope_scale, skip_tol and bias_table as for attention()."""
    params = [_as_param(x) for x in (delta, beta, gamma, lam)]
    table = _as_table(bias_table)
    dev = _pick_device(device, (q, k, v, *params), table)
    _omp_check(q)
    args = (q, k, v, *params, *(_index_tensor(x) for x in (cu_seqlens_q, cu_seqlens_k,
                                                           positions_q, positions_k)),
            bool(causal), None if scale is None else float(scale), float(rope_base),
            float(rope_scale), layout, dev, None if skip_tol is None else float(skip_tol),
            table)
    o, lse = _VarlenFunction.apply(*args) if _use_function(args[:11] + (table,)) \
        else _op_varlen(*args)
    return (o, lse) if return_lse else o


# ------------------------------------------------------------------ the seed's module

class APEAttention(torch.nn.Module):
    """The seed's APE attention layer: `forward(q, k, v)` on `[B, H, L, D]` tensors (k, v may
    have fewer heads, H % Hkv == 0) returns O `[B, H, L, D]`.

    Learnable `delta`, `beta`, `gamma`, `lambda_`: one per head (shape [H], per_head=True) or
    one shared by all heads (shape []), initialised as the seed says: delta = 2^(-4/3),
    beta = gamma = delta / 10, lambda = 0.1. Gradients of all four come from libape's backward
    pass (for a shared parameter, the sum over heads).

    lambda >= 0 is kept by projection: every forward call first clamps `lambda_` in place to
    [0, inf) (under no_grad), so an optimizer step that takes it below 0 is undone before the
    next use, and its gradient at 0 still lets it grow again. The value read from `lambda_` is
    always the one used. (delta, beta, gamma may be any finite value.)

    `device` as for libape.torch.attention (None: grad_device() while training, "auto"
    otherwise);
    causal, scale, rope_base, layout and rope_scale as for libape.attention (rope_scale, an
    attribute, may be changed to run a trained layer at a longer context: position
    interpolation); skip_tol as for libape.torch.attention (None: 2^-24 in both passes; 0: every
    pair).

    bias_table_len=M > 0 also learns a distance-bias table `bias_table` (libape.torch.attention's),
    `[H, M]` (`[1, M]`, shared by every head, with per_head=False), initialised to zeros (no
    change to the scores until trained): a T5 / Transformer-XL style relative bias learned
    beside the four parameters, distances M - 1 and beyond sharing its last entry. 0 (the
    default): none (`bias_table` is None).
    """

    def __init__(self, num_heads, head_dim, *, per_head=True, causal=True, scale=None,
                 rope_base=10000.0, layout="half", device=None, dtype=torch.float32,
                 rope_scale=1.0, skip_tol=None, bias_table_len=0):
        super().__init__()
        if head_dim % 2 or not 2 <= head_dim <= 256:
            _core._bad("head_dim = %r: must be even, 2..256" % (head_dim,))
        self.num_heads, self.head_dim, self.per_head = int(num_heads), int(head_dim), per_head
        self.causal, self.scale, self.rope_base, self.layout = causal, scale, rope_base, layout
        self.rope_scale = rope_scale
        self.skip_tol = skip_tol
        self.device_spec = device
        shape = (self.num_heads,) if per_head else ()

        def param(value):
            return torch.nn.Parameter(torch.full(shape, value, dtype=dtype))

        self.delta = param(SEED_DELTA)
        self.beta = param(SEED_BETA)
        self.gamma = param(SEED_GAMMA)
        self.lambda_ = param(SEED_LAMBDA)
        if int(bias_table_len) < 0 or int(bias_table_len) != bias_table_len:
            _core._bad("bias_table_len = %r: must be an int >= 0 (0: no table)"
                       % (bias_table_len,))
        self.bias_table_len = int(bias_table_len)
        if self.bias_table_len:
            rows = self.num_heads if per_head else 1
            self.bias_table = torch.nn.Parameter(
                torch.zeros((rows, self.bias_table_len), dtype=dtype))
        else:
            self.register_parameter("bias_table", None)

    def forward(self, q, k, v, *, cu_seqlens=None, positions=None):
        """q, k, v `[B, H, L, D]`; or, with cu_seqlens (S + 1 offsets), a packed batch of
        documents `[total, H, D]` (attention within each document only, as
        libape.torch.attention_varlen with cu_seqlens for queries and keys), optionally with
        `positions` `[total]` (int64) for both."""
        if cu_seqlens is not None:
            if q.dim() != 3 or q.shape[1] != self.num_heads or q.shape[2] != self.head_dim:
                _core._bad("q: shape %s: with cu_seqlens must be [total, %d, %d]"
                           % (tuple(q.shape), self.num_heads, self.head_dim))
            with torch.no_grad():
                self.lambda_.clamp_(min=0.0)
            return attention_varlen(q, k, v, cu_seqlens, cu_seqlens, positions_q=positions,
                                    positions_k=positions, delta=self.delta, beta=self.beta,
                                    gamma=self.gamma, lam=self.lambda_, causal=self.causal,
                                    scale=self.scale, rope_base=self.rope_base,
                                    layout=self.layout, device=self.device_spec,
                                    rope_scale=self.rope_scale, skip_tol=self.skip_tol,
                                    bias_table=self.bias_table)
        if positions is not None:
            _core._bad("positions: needs cu_seqlens (a packed batch)")
        if q.dim() != 4 or q.shape[1] != self.num_heads or q.shape[3] != self.head_dim:
            _core._bad("q: shape %s: must be [B, %d, L, %d]"
                       % (tuple(q.shape), self.num_heads, self.head_dim))
        with torch.no_grad():
            self.lambda_.clamp_(min=0.0)
        return attention(q, k, v, delta=self.delta, beta=self.beta, gamma=self.gamma,
                         lam=self.lambda_, causal=self.causal, scale=self.scale,
                         rope_base=self.rope_base, layout=self.layout,
                         device=self.device_spec, rope_scale=self.rope_scale,
                         skip_tol=self.skip_tol, bias_table=self.bias_table)

    def extra_repr(self):
        return "num_heads=%d, head_dim=%d, per_head=%s, causal=%s, %sdevice=%s" % (
            self.num_heads, self.head_dim, self.per_head, self.causal,
            "bias_table_len=%d, " % self.bias_table_len if self.bias_table_len else "",
            self.device_spec if self.device_spec is not None else "None (ref to train, auto)")


"""fla's gated backward where fla itself refuses it: Hopper with Triton >= 3.4.0, < 3.7.1.

There Triton miscompiles fla's ``chunk_bwd_kernel_dqkwg`` (the dq, dk, dw, dg kernel of the
scalar-gated chunk backward: gated delta rule, simple GLA) when it runs with 64-wide key
tiles, and fla 0.6 raises rather than return wrong gradients (fla issue #640; the analysis
there shows 128-wide tiles compute correctly, and fla itself takes 128 on Hopper for head
widths above 64). Triton 3.7.1 (torch >= 2.12.1) fixes the compiler; tilelang gives fla
another backend. Neither may be at hand (torch 2.11 pins Triton 3.6), and the alternative,
looplm's float32 PyTorch chunk op, is several times slower than fla's kernels. So on such a
device, and only there:

* :func:`use_wide_tiles` has fla's gated delta rule and simple GLA call
  :func:`wide_tile_dqkwg`: fla's own kernel launched with 128-wide key and value tiles
  (the kernel masks the columns past the head width), instead of the host function that
  raises;
* :func:`verified_backward` runs each gated op a model uses once per process, device, dtype
  and head widths, through fla (forward and backward, on random inputs of two chunks) and
  through looplm's PyTorch op in float32, and lets the op train on fla only if every output
  and gradient agrees (relative RMS error <= :data:`TOLERANCE`; the compiler bug gives
  ~0.5). The verdict and the errors are logged. Per-key-channel gates (KDA, GLA, HGRN2) run
  other fla kernels and are checked the same way.

Nothing here runs on other devices: elsewhere fla's gated backward is used as fla ships it.
"""

from __future__ import annotations

import inspect
import logging
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

logger = logging.getLogger("looplm")

#: relative RMS error (‖a − b‖ / ‖b‖ over elements) allowed between fla's result and the float32
#: PyTorch op's, for the output and every gradient (bf16 kernels land near 0.01)
TOLERANCE = 0.05
#: the key and value tile width :func:`wide_tile_dqkwg` launches fla's kernel with
WIDE = 128
#: the parameters of fla's ``chunk_bwd_dqkwg`` host function :func:`wide_tile_dqkwg` stands in for
DQKWG_PARAMETERS = ("q", "k", "v", "do", "h", "dh", "w", "g", "g_gamma", "dv", "scale", "state_v_first",
                    "cu_seqlens", "chunk_size", "chunk_indices")
#: the fla modules whose gated backward calls ``chunk_bwd_dqkwg`` with a gate, as looplm uses them
PATCHED_MODULES = ("fla.ops.gated_delta_rule.chunk", "fla.ops.simple_gla.chunk")


class GatedOp(NamedTuple):
    """A decay-gated op a mixer trains through fla: ``family`` "delta" (gated delta rule;
    KDA with ``channels``) or "decay" (simple GLA: RetNet, Mamba2; GLA, HGRN2 with
    ``channels``), with its heads H and head widths K (keys) and V (values): fla's kernels
    are compiled per such shape (they are constants of the kernels), so the check runs them."""

    family: str
    channels: bool
    H: int
    K: int
    V: int


_VERDICTS: dict[tuple, bool] = {}  # (op, device, dtype) -> verdict; a plain dict Dynamo reads as a constant


def verified_backward(op: GatedOp, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``op`` trains on fla on ``device`` in ``dtype``: checked against the PyTorch op
    the first time it is asked (module docstring), then remembered. Never checked inside a
    torch.compile trace (an eager call decides first; until then the op trains on PyTorch)."""
    key = (op, str(device), dtype)
    if key in _VERDICTS:
        return _VERDICTS[key]
    if torch.compiler.is_compiling():
        return False
    use_wide_tiles()
    # asked from inside a forward, maybe under bf16 autocast: the reference must run in float32
    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        try:
            errors = backward_errors(op, device, dtype)
        except Exception as error:  # fla refused or failed to run: a failed check, not a failed forward
            errors = {f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}": float("inf")}
    worst = max(errors, key=errors.get)
    verdict = all(error <= TOLERANCE for error in errors.values())
    _VERDICTS[key] = verdict
    logger.info("fla's gated backward (%s, %s, H=%d, K=%d, V=%d, %s) on %s %s its check against PyTorch: "
                "largest relative error %.2g (%s)%s", op.family, "per channel" if op.channels else "scalar", op.H,
                op.K, op.V, str(dtype).removeprefix("torch."), torch.cuda.get_device_name(device),
                "passes" if verdict else "fails", errors[worst], worst,
                "" if verdict else "; this op trains on looplm's PyTorch kernels")
    return verdict


def verdicts() -> dict[tuple, bool]:
    """The verdicts reached in this process: (op, device, dtype) -> trains on fla."""
    return dict(_VERDICTS)


def backward_errors(op: GatedOp, device: torch.device, dtype: torch.dtype, batch: int = 2, length: int = 128,
                    seed: int = 0) -> dict[str, float]:
    """Relative RMS errors of fla's output and gradients against the float32 PyTorch op, on
    random inputs: ``length`` positions (two of the ops' 64-position chunks), keys normalised
    as the layers do, gates log α in (−1.3, −0.05)."""
    from looplm.ops.decay import chunk_decay, fla_decay
    from looplm.ops.delta import chunk_delta_rule, fla_delta_rule

    g = torch.Generator(device=device).manual_seed(seed)
    B, T, H, K, V = batch, length, op.H, op.K, op.V

    def rand(*shape):
        return torch.randn(*shape, generator=g, device=device)

    gate_shape = (B, T, H, K) if op.channels else (B, T, H)
    inputs = {"q": rand(B, T, H, K), "k": F.normalize(rand(B, T, H, K), dim=-1), "v": rand(B, T, H, V),
              "log_alpha": -0.05 - 1.25 * torch.rand(*gate_shape, generator=g, device=device)}
    if op.family == "delta":
        inputs["beta"] = torch.rand(B, T, H, generator=g, device=device)
    grad_out = rand(B, T, H, V)

    def run(fla: bool) -> dict[str, torch.Tensor]:
        cast = {name: (x.to(dtype) if fla and name in ("q", "k", "v") else x).requires_grad_() for name, x in
                ((name, x.clone()) for name, x in inputs.items())}
        q, k, v, log_alpha = cast["q"], cast["k"], cast["v"], cast["log_alpha"]
        if op.family == "delta":
            if fla:
                o, _ = fla_delta_rule(q, k, v, cast["beta"], log_alpha, None, step=False)
            else:
                o, _ = chunk_delta_rule(q, k, v, cast["beta"], log_alpha, output_final_state=True)
        elif fla:
            o, _ = fla_decay(q, k, v, log_alpha, output_final_state=True)
        else:
            o, _ = chunk_decay(q, k, v, log_alpha, output_final_state=True)
        grads = torch.autograd.grad((o.float() * grad_out).sum(), list(cast.values()))
        return {"o": o.detach().float(), **{f"d{name}": grad.float() for name, grad in zip(cast, grads)}}

    fla_result, reference = run(True), run(False)
    return {name: _relative_error(fla_result[name], reference[name]) for name in reference}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖a − b‖ / ‖b‖ (fla's tests' ratio), 0 for two zero tensors; inf when ``a`` is not finite."""
    if not torch.isfinite(a).all():
        return float("inf")
    difference, scale = (a - b).norm().item(), b.norm().item()
    if scale == 0:
        return 0.0 if difference == 0 else float("inf")
    return difference / scale


def use_wide_tiles() -> bool:
    """Have fla's gated delta rule and simple GLA compute their dq, dk, dw, dg with
    :func:`wide_tile_dqkwg`. Idempotent; False (nothing changed) when fla's host function has
    other parameters than the ones this stands in for (another fla version)."""
    import importlib

    from fla.ops.common import chunk_o

    if tuple(inspect.signature(chunk_o.chunk_bwd_dqkwg).parameters) != DQKWG_PARAMETERS:
        logger.info("fla's chunk_bwd_dqkwg has other parameters than fla 0.6's: its 64-wide tiles stay")
        return False
    for name in PATCHED_MODULES:
        module = importlib.import_module(name)
        if getattr(module, "chunk_bwd_dqkwg", None) is not None:
            module.chunk_bwd_dqkwg = wide_tile_dqkwg
    return True


def wide_tile_dqkwg(q, k, v, do, h, dh, w=None, g=None, g_gamma=None, dv=None, scale=None, state_v_first=False,
                    cu_seqlens=None, chunk_size=64, chunk_indices=None) -> tuple[
                        torch.Tensor, torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """fla's chunk backward for dq, dk (and dw, dg): its ``chunk_bwd_kernel_dqkwg`` launched
    with :data:`WIDE` key and value tiles, one program per (key tile, chunk) and (batch,
    value head). The arguments and results of fla's ``chunk_bwd_dqkwg``: q, k [B, T, H, K],
    v, do, dv [B, T, HV, V], the chunk states h, dh; results summed over key tiles (dg) and
    over the value heads sharing a key head (dq, dk)."""
    from fla.ops.common.chunk_o import chunk_bwd_kernel_dqkwg
    from fla.ops.utils import prepare_chunk_indices

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    if chunk_indices is None and cu_seqlens is not None:
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size)
    chunks = -(-T // chunk_size) if cu_seqlens is None else len(chunk_indices)
    key_tiles = -(-K // WIDE)
    dq, dk = q.new_empty(B, T, HV, K), k.new_empty(B, T, HV, K)
    dw = None if w is None else torch.empty_like(w)
    dg = None if g is None else torch.empty(key_tiles, *g.shape, dtype=torch.float32, device=g.device)
    chunk_bwd_kernel_dqkwg[(key_tiles * chunks, B * HV)](
        q=q, k=k, v=v, g=g, g_gamma=g_gamma, h=h, do=do, dh=dh, dq=dq, dk=dk, dw=dw, dv=dv, dg=dg,
        cu_seqlens=cu_seqlens, chunk_indices=chunk_indices, scale=scale, B=B, T=T, H=H, HV=HV, K=K, V=V,
        BT=chunk_size, BK=WIDE, BV=WIDE, STATE_V_FIRST=state_v_first,
    )
    if H != HV:
        dq, dk = (x.view(B, T, H, HV // H, K).sum(3) for x in (dq, dk))
    return dq, dk, dw, None if dg is None else dg.sum(0)

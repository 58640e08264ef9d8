"""RoPE and the drafter's training-time-test (TTT) attention.

A query at TTT step k attends causally to the step-0 keys plus, from each step 1..k, only the
key at its own position (the "diagonal"). `DiagonalTTTAttention` computes those extra keys as
element-wise dot products merged by log-sum-exp with the causal block, so no (L x L) scores are
kept for backward, let alone (L x L*K). Two kernels compute the same numbers, named so a caller
(and the CPU test suite) can run either on any machine where it runs:

    "flash"    the CPU's flash-attention kernel, which returns the causal block's log-sum-exp
               with its output: one pass each way (`FlashDiagonalAttention`); CPU only
    "chunked"  fused SDPA for the causal block plus its log-sum-exp made `chunk_size` queries at
               a time (`CausalLogSumExp`, SDPA-based backward), merged in fp32; any device

`default_kernel` is what a device runs when no kernel is named. tests/ttt_reference.py holds
the naive full-mask version both are tested against.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

DEFAULT_QUERY_CHUNK = 1024
FLASH, CHUNKED = "flash", "chunked"
TTT_KERNELS = (FLASH, CHUNKED)


# ---------------------------------------------------------------------------------------------
# RoPE
# ---------------------------------------------------------------------------------------------


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [..., head_dim] for positions of any shape ([L], or [B, L] packed), Llama's
    half-rotation layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float32) / head_dim))
    angles = positions.float()[..., None] * inv_freq
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos.to(x.dtype)) + (rotated * sin.to(x.dtype))


# ---------------------------------------------------------------------------------------------
# Masks and the causal block
# ---------------------------------------------------------------------------------------------


def allowed_keys(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool [q, k]: query position t sees step-0 key position s when s <= t (and s > t - window)."""
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= keys[None, :] > queries[:, None] - window
    return allowed


def document_keys(
    queries: torch.Tensor, keys: torch.Tensor, window: int | None, documents: torch.Tensor | None
) -> torch.Tensor:
    """`allowed_keys`, and in packed rows ([B, L] `documents`) only keys of the query's own
    document: [q, k], or [B, q, k] packed. Documents are contiguous, so a window counted in row
    positions is the same window within the document."""
    allowed = allowed_keys(queries, keys, window)
    if documents is None:
        return allowed
    return allowed[None] & (documents[:, queries, None] == documents[:, None, keys])


def step0_mask(L: int, window: int | None, documents: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Bool [L, L] or [B, 1, L, L]: the step-0 keys each query sees (causal, window, own document)."""
    positions = torch.arange(L, device=device)
    mask = document_keys(positions, positions, window, documents)
    return mask if documents is None else mask[:, None]


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, documents: torch.Tensor | None = None
) -> torch.Tensor:
    """SDPA over step-0 keys: causal, or causal within a sliding window (a boolean band mask);
    packed rows (`documents`) within each document (a block-diagonal mask per row)."""
    gqa = q.shape[1] != k.shape[1]
    if documents is None and (window is None or window >= k.shape[2]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=step0_mask(k.shape[2], window, documents, q.device), enable_gqa=gqa
    )


@torch.no_grad()
def causal_lse(
    q: torch.Tensor,
    k: torch.Tensor,
    chunk_size: int = DEFAULT_QUERY_CHUNK,
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """log sum_{s<=t} exp(scale q_t.k_s) per query, [B, heads, L], at least fp32; (chunk x L) scores at a time.
    Packed rows (`documents`): over the keys of the query's own document only."""
    B, nh, L, d = q.shape
    nkv = k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)  # at least fp32
    qg, kf = q.to(work).view(B, nkv, nh // nkv, L, d), k.to(work)
    out = []
    for s in range(0, L, chunk_size):
        e = min(L, s + chunk_size)
        scores = torch.einsum("bhgcd,bhsd->bhgcs", qg[:, :, :, s:e], kf[:, :, :e]) * d**-0.5
        allowed = document_keys(
            torch.arange(s, e, device=q.device), torch.arange(e, device=q.device), window, documents
        )
        if documents is not None:  # [B, c, e] -> over kv heads and their query groups
            allowed = allowed[:, None, None]
        out.append(torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1))
    return torch.cat(out, dim=-1).reshape(B, nh, L)


class CausalLogSumExp(torch.autograd.Function):
    """Differentiable `causal_lse`. Its gradients are attention outputs, so backward uses SDPA:
    d lse_t / d q_t = scale * sum_s p_ts k_s = scale * SDPA(q, k, k)_t, and
    d lse_t / d k_s = scale * p_ts q_t, i.e. the value-gradient of SDPA(q, k, .) for grad g*q."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        chunk_size: int,
        window: int | None,
        documents: torch.Tensor | None = None,
    ) -> torch.Tensor:
        ctx.save_for_backward(q, k)
        ctx.window, ctx.documents = window, documents
        return causal_lse(q, k, chunk_size, window, documents)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        q, k = ctx.saved_tensors
        scale = q.shape[-1] ** -0.5
        with torch.enable_grad():
            values = k.detach().requires_grad_(True)
            pk = causal_attention(q.detach(), k.detach(), values, ctx.window, ctx.documents)
            (dk,) = torch.autograd.grad(pk, values, grad_outputs=grad.unsqueeze(-1).to(q.dtype) * q)
        return scale * grad.unsqueeze(-1) * pk.detach(), scale * dk, None, None, None


# ---------------------------------------------------------------------------------------------
# The two kernels of the diagonal TTT attention
# ---------------------------------------------------------------------------------------------


def chunked_diagonal_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    chunk_size: int,
    window: int | None,
    documents: torch.Tensor | None,
) -> torch.Tensor:
    """The "chunked" kernel: the causal block is fused SDPA (its output o_c) plus its log-sum-exp
    lse_c (`CausalLogSumExp`, scores made `chunk_size` queries at a time and never kept); the
    diagonal keys dk/dv [k, B, kv, L, d] give element-wise dot products s_j. One softmax over all:
        out = exp(lse_c - lse) o_c + sum_j exp(s_j - lse) v_j,  lse = logsumexp(lse_c, s_1..s_k).
    GQA: query heads are grouped over their kv head."""
    o_c = causal_attention(q, k0, v0, window, documents)
    B, nh, L, d = q.shape
    nkv = k0.shape[1]
    with torch.autocast(q.device.type, enabled=False):  # the merge stays fp32 under bf16 autocast
        lse_c = CausalLogSumExp.apply(q.float(), k0.float(), chunk_size, window, documents).view(
            B, nkv, nh // nkv, L, 1
        )
        qg = q.float().view(B, nkv, nh // nkv, L, d)
        diag = torch.einsum("bhgld,kbhld->bhglk", qg, dk.float()) * d**-0.5  # one dot product per position and step
        lse = torch.logsumexp(torch.cat([lse_c, diag], dim=-1), dim=-1, keepdim=True)
        out = torch.exp(lse_c - lse) * o_c.float().view(B, nkv, nh // nkv, L, d)
        out = out + torch.einsum("bhglk,kbhld->bhgld", torch.exp(diag - lse), dv.float())
    return out.reshape(B, nh, L, d).to(q.dtype)


class FlashDiagonalAttention(torch.autograd.Function):
    """The "flash" kernel: `chunked_diagonal_attention`'s numbers in one CPU flash-attention pass each way.

    Forward: the flash kernel's causal output o_c and its log-sum-exp lse_c (one fused call),
    the diagonal scores s_j, and out = a o_c + sum_j b_j v_j with a = exp(lse_c - lse),
    b_j = exp(s_j - lse). Backward: the whole softmax's score gradient on the causal block is
    a p_c (dO.v_s - dO.out); the kernel's backward computes exactly that when given the gradient
    a dO and the *merged* output (its row term is rowsum(grad * out) = a dO.out). The diagonal
    keys' gradients are element-wise. So no second attention pass, no (L x L) scores kept, where
    the log-sum-exp's own backward (`CausalLogSumExp`) needs two more in fp32."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k0: torch.Tensor,
        v0: torch.Tensor,
        dk: torch.Tensor,
        dv: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        B, nh, L, d = q.shape
        nkv = k0.shape[1]
        g = nh // nkv
        k0, v0 = k0.repeat_interleave(g, dim=1), v0.repeat_interleave(g, dim=1)  # the kernel wants equal heads
        if mask is not None:  # the kernel takes an additive mask of the query's dtype
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        o_c, lse_c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k0, v0, 0.0, mask is None, attn_mask=mask
        )
        qg = q.float().view(B, nkv, g, L, d)
        diag = torch.einsum("bhgld,kbhld->bhglk", qg, dk.float()) * d**-0.5
        lse_c = lse_c.float().view(B, nkv, g, L, 1)
        lse = torch.logsumexp(torch.cat([lse_c, diag], dim=-1), dim=-1, keepdim=True)
        a, b = torch.exp(lse_c - lse), torch.exp(diag - lse)
        out = a * o_c.float().view(B, nkv, g, L, d) + torch.einsum("bhglk,kbhld->bhgld", b, dv.float())
        result = out.reshape(B, nh, L, d).to(q.dtype)
        ctx.save_for_backward(q, k0, v0, dk, dv, result, lse_c.view(B, nh, L), a, b, mask)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):
        q, k0, v0, dk, dv, out, lse_c, a, b, mask = ctx.saved_tensors
        B, nh, L, d = q.shape
        nkv, g, scale = dk.shape[2], nh // dk.shape[2], q.shape[-1] ** -0.5
        gf = grad.float().view(B, nkv, g, L, d)
        grad_c = (a * gf).reshape(B, nh, L, d).to(q.dtype)
        dq, dk0, dv0 = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_c, q, k0, v0, out, lse_c, 0.0, mask is None, attn_mask=mask
        )
        row = (gf * out.float().view(B, nkv, g, L, d)).sum(-1, keepdim=True)  # dO.out per query
        ds = b * (torch.einsum("bhgld,kbhld->bhglk", gf, dv.float()) - row)  # the diagonal scores' gradients
        dq = dq.float().view(B, nkv, g, L, d) + scale * torch.einsum("bhglk,kbhld->bhgld", ds, dk.float())
        qg = q.float().view(B, nkv, g, L, d)
        ddk = scale * torch.einsum("bhglk,bhgld->kbhld", ds, qg)
        ddv = torch.einsum("bhglk,bhgld->kbhld", b, gf)
        return (
            dq.reshape(B, nh, L, d).to(q.dtype),
            dk0.view(B, nkv, g, L, d).sum(2).to(k0.dtype),
            dv0.view(B, nkv, g, L, d).sum(2).to(v0.dtype),
            ddk.to(dk.dtype),
            ddv.to(dv.dtype),
            None,
        )


def flash_diagonal_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    window: int | None,
    documents: torch.Tensor | None,
) -> torch.Tensor:
    """The "flash" kernel (`FlashDiagonalAttention`) with its step-0 mask; the CPU's only."""
    if q.device.type != "cpu":
        raise ValueError(f"the {FLASH!r} TTT kernel is the CPU's flash attention; on {q.device.type} use {CHUNKED!r}")
    mask = None if documents is None and window is None else step0_mask(q.shape[2], window, documents, q.device)
    with torch.autocast(q.device.type, enabled=False):  # the kernel's own dtype handling, fp32 merge
        return FlashDiagonalAttention.apply(q, k0, v0, dk, dv, mask)


def default_kernel(device: torch.device) -> str:
    """The kernel a device runs when none is named: the CPU's flash kernel gives the log-sum-exp
    with the output (fewer passes); other devices have no such kernel in PyTorch, so "chunked"."""
    return FLASH if device.type == "cpu" else CHUNKED


def check_kernel(kernel: str) -> str:
    if kernel not in TTT_KERNELS:
        raise ValueError(f"unknown TTT attention kernel {kernel!r}: one of {', '.join(TTT_KERNELS)}")
    return kernel


def diagonal_ttt_attention(
    q: torch.Tensor,
    k0: torch.Tensor,
    v0: torch.Tensor,
    diag_k: list[torch.Tensor],
    diag_v: list[torch.Tensor],
    kernel: str,
    chunk_size: int = DEFAULT_QUERY_CHUNK,
    window: int | None = None,
    documents: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over step-0 keys plus one same-position key per later step, jointly
    softmaxed, by the named `kernel` ("flash" or "chunked"; `chunk_size` is the chunked one's).
    `window`: the causal block sees only the last `window` positions; `documents` [B, L] (packed
    rows): only its own document's."""
    if not diag_k:  # step 0 (or TTT 1): plain causal attention, whichever kernel
        return causal_attention(q, k0, v0, window, documents)
    dk, dv = torch.stack(diag_k), torch.stack(diag_v)  # [k, B, kv, L, d]
    if check_kernel(kernel) == FLASH:
        return flash_diagonal_attention(q, k0, v0, dk, dv, window, documents)
    return chunked_diagonal_attention(q, k0, v0, dk, dv, chunk_size, window, documents)


# ---------------------------------------------------------------------------------------------
# The attention core of one TTT unroll
# ---------------------------------------------------------------------------------------------


class TTTAttentionCore(Protocol):
    """Holds the keys/values of earlier TTT steps of one unroll; returns attention outputs.

    Called once per step with roped q [B, heads, L, d] and k, v [B, kv_heads, L, d]. `window`
    (set by the drafter from its config) limits the step-0 keys to the last `window` positions;
    `documents` ([B, L] document number of each position, set by the drafter for packed rows)
    limits them to the query's own document."""

    window: int | None
    documents: torch.Tensor | None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


class DiagonalTTTAttention:
    """The efficient TTT attention core: keeps step-0 keys and the per-step diagonal keys.
    `kernel` names how it computes ("flash" or "chunked"); None: the device's `default_kernel`."""

    def __init__(
        self,
        kernel: str | None = None,
        chunk_size: int = DEFAULT_QUERY_CHUNK,
        window: int | None = None,
        documents: torch.Tensor | None = None,
    ) -> None:
        self.kernel = None if kernel is None else check_kernel(kernel)
        self.chunk_size, self.window, self.documents = chunk_size, window, documents
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k0 is None or self.v0 is None:
            self.k0, self.v0 = k, v
        else:
            self.diag_k.append(k)
            self.diag_v.append(v)
        return diagonal_ttt_attention(
            q,
            self.k0,
            self.v0,
            self.diag_k,
            self.diag_v,
            self.kernel or default_kernel(q.device),
            self.chunk_size,
            self.window,
            self.documents,
        )

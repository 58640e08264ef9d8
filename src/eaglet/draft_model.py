"""The EAGLE-3 draft model ("drafter") in plain PyTorch, and its training-time-test (TTT) unroll.

Architecture (module names are the EAGLE / SGLang checkpoint keys, so export is a copy):

    g      = fc(concat(aux_low, aux_mid, aux_high))          # 3H -> H, fused target features
    x      = concat(input_layernorm(embed(token)), hidden_norm(g))   # 2H, input of q/k/v
    h      = g + o_proj(attention(q, k, v))                  # residual is g, not x (norm_before_residual:
                                                             # hidden_norm(g), speculators' default)
    h      = h + mlp(post_attention_layernorm(h))            # SwiGLU
    logits = lm_head(norm(h))                                # H -> draft vocab

TTT (`Eagle3Draft.forward`): step 0 sees the target's fused features; step k feeds the
drafter's own output `h` of step k-1 at the same position, with the input token shifted one
further (teacher forced). A query at step k attends causally to the step-0 keys plus, from each
step 1..k, only the key at its own position (the "diagonal"). `DiagonalTTTAttention` computes
those extra keys as element-wise dot products merged by log-sum-exp with the causal block, which
stays fused SDPA (its log-sum-exp has an SDPA-based backward), so no (L x L) scores are kept for
backward, let alone (L x L*K). `bench/ttt_reference.py` holds the naive
full-mask version that the tests compare against.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_DRAFT_VOCAB = 8192  # bench/train_efficiency.py: 8k beat 16k and 32k at equal time on a CPU
DEFAULT_TTT_STEPS = 2  # the chain of 2 a CPU drafts; EAGLE-3 on GPUs trains 7
STEP_WEIGHT_DECAY = 0.8


# ---------------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------------

@dataclass
class DraftConfig:
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    target_vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: list[int] = field(default_factory=list)
    fc_norm: bool = False  # EAGLE-3.1: RMSNorm over the 3H concat before fc
    norm_output: bool = False  # EAGLE-3.1: feed the post-norm output to the next TTT step
    norm_before_residual: bool = False  # residual = hidden_norm(g) instead of g (speculators' default)
    sliding_window: int | None = None  # step-0 keys a query sees: the last W positions (None: all)
    target_hidden_size: int | None = None  # width of the aux states (defaults to hidden_size)

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if not 0 < self.draft_vocab_size <= self.target_vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, {self.target_vocab_size}]")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window {self.sliding_window} must be >= 1 (or None for full attention)")

    @classmethod
    def from_target(cls, target_config: Any, aux_layer_ids: list[int], draft_vocab_size: int | None = None,
                    **overrides: Any) -> DraftConfig:
        """One Llama layer shaped like the target's layers (the EAGLE-3 default)."""
        c = target_config
        heads = c.num_attention_heads
        rope = getattr(c, "rope_parameters", None) or {}
        vocab = c.vocab_size
        values = dict(
            hidden_size=c.hidden_size, num_heads=heads, num_kv_heads=getattr(c, "num_key_value_heads", None) or heads,
            head_dim=getattr(c, "head_dim", None) or c.hidden_size // heads, intermediate_size=c.intermediate_size,
            rms_norm_eps=getattr(c, "rms_norm_eps", 1e-6),
            rope_theta=getattr(c, "rope_theta", None) or rope.get("rope_theta", 10000.0),
            max_position_embeddings=getattr(c, "max_position_embeddings", 4096), target_vocab_size=vocab,
            draft_vocab_size=draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, vocab), aux_layer_ids=list(aux_layer_ids),
            target_hidden_size=c.hidden_size)
        values.update(overrides)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ---------------------------------------------------------------------------------------------
# Draft vocabulary
# ---------------------------------------------------------------------------------------------

def build_draft_vocab(token_freq: dict[int, int], target_vocab_size: int,
                      draft_vocab_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t, t2d) for the `draft_vocab_size` most frequent loss-masked tokens.

    Draft ids are the chosen target ids in ascending order (as EAGLE does), so
    `target_id = i + d2t[i]`. When the data has fewer distinct tokens than the draft vocab, the
    lowest unused target ids fill it: a short vocab crashes engines that assume the size.
    """
    size = draft_vocab_size or min(DEFAULT_DRAFT_VOCAB, target_vocab_size)
    if not 0 < size <= target_vocab_size:
        raise ValueError(f"draft vocab size {size} must be in [1, target vocab {target_vocab_size}]")
    ranked = sorted(((c, t) for t, c in token_freq.items() if 0 <= t < target_vocab_size and c > 0),
                    key=lambda ct: (-ct[0], ct[1]))
    chosen = {t for _, t in ranked[:size]}
    filler = (t for t in range(target_vocab_size) if t not in chosen)
    while len(chosen) < size:
        chosen.add(next(filler))
    draft_ids = torch.tensor(sorted(chosen), dtype=torch.long)
    d2t = draft_ids - torch.arange(size, dtype=torch.long)
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return d2t, t2d


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in fp32 (as Llama does): bf16 variance loses too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


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


class TTTAttentionCore(Protocol):
    """Holds the keys/values of earlier TTT steps of one unroll; returns attention outputs.

    Called once per step with roped q [B, heads, L, d] and k, v [B, kv_heads, L, d]. `window`
    (set by the drafter from its config) limits the step-0 keys to the last `window` positions;
    `documents` ([B, L] document number of each position, set by the drafter for packed rows)
    limits them to the query's own document."""

    window: int | None
    documents: torch.Tensor | None

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor: ...


DEFAULT_QUERY_CHUNK = 1024


def allowed_keys(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Bool [q, k]: query position t sees step-0 key position s when s <= t (and s > t - window)."""
    allowed = keys[None, :] <= queries[:, None]
    if window is not None:
        allowed &= keys[None, :] > queries[:, None] - window
    return allowed


def document_keys(queries: torch.Tensor, keys: torch.Tensor, window: int | None,
                  documents: torch.Tensor | None) -> torch.Tensor:
    """`allowed_keys`, and in packed rows ([B, L] `documents`) only keys of the query's own
    document: [q, k], or [B, q, k] packed. Documents are contiguous, so a window counted in row
    positions is the same window within the document."""
    allowed = allowed_keys(queries, keys, window)
    if documents is None:
        return allowed
    return allowed[None] & (documents[:, queries, None] == documents[:, None, keys])


@torch.no_grad()
def causal_lse(q: torch.Tensor, k: torch.Tensor, chunk_size: int = DEFAULT_QUERY_CHUNK,
               window: int | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """log sum_{s<=t} exp(scale q_t.k_s) per query, [B, heads, L], at least fp32; (chunk x L) scores at a time.
    Packed rows (`documents`): over the keys of the query's own document only."""
    B, nh, L, d = q.shape
    nkv = k.shape[1]
    work = torch.promote_types(q.dtype, torch.float32)  # at least fp32
    qg, kf = q.to(work).view(B, nkv, nh // nkv, L, d), k.to(work)
    out = []
    for s in range(0, L, chunk_size):
        e = min(L, s + chunk_size)
        scores = torch.einsum("bhgcd,bhsd->bhgcs", qg[:, :, :, s:e], kf[:, :, :e]) * d ** -0.5
        allowed = document_keys(torch.arange(s, e, device=q.device), torch.arange(e, device=q.device), window,
                                documents)
        if documents is not None:  # [B, c, e] -> over kv heads and their query groups
            allowed = allowed[:, None, None]
        out.append(torch.logsumexp(scores.masked_fill(~allowed, float("-inf")), dim=-1))
    return torch.cat(out, dim=-1).reshape(B, nh, L)


class CausalLogSumExp(torch.autograd.Function):
    """Differentiable `causal_lse`. Its gradients are attention outputs, so backward uses SDPA:
    d lse_t / d q_t = scale * sum_s p_ts k_s = scale * SDPA(q, k, k)_t, and
    d lse_t / d k_s = scale * p_ts q_t, i.e. the value-gradient of SDPA(q, k, .) for grad g*q."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, chunk_size: int, window: int | None,
                documents: torch.Tensor | None = None) -> torch.Tensor:
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


def step0_mask(L: int, window: int | None, documents: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """Bool [L, L] or [B, 1, L, L]: the step-0 keys each query sees (causal, window, own document)."""
    positions = torch.arange(L, device=device)
    mask = document_keys(positions, positions, window, documents)
    return mask if documents is None else mask[:, None]


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None,
                     documents: torch.Tensor | None = None) -> torch.Tensor:
    """SDPA over step-0 keys: causal, or causal within a sliding window (a boolean band mask);
    packed rows (`documents`) within each document (a block-diagonal mask per row)."""
    gqa = q.shape[1] != k.shape[1]
    if documents is None and (window is None or window >= k.shape[2]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=step0_mask(k.shape[2], window, documents, q.device),
                                          enable_gqa=gqa)


def diagonal_ttt_attention(q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, diag_k: list[torch.Tensor],
                           diag_v: list[torch.Tensor], chunk_size: int = DEFAULT_QUERY_CHUNK,
                           window: int | None = None, documents: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention over step-0 keys plus one same-position key per later step, jointly softmaxed.

    The causal block is fused SDPA (its output o_c) plus its log-sum-exp lse_c (`CausalLogSumExp`,
    scores made `chunk_size` queries at a time and never kept); the k diagonal keys are
    element-wise dot products s_j. One softmax over all of them:
        out = exp(lse_c - lse) o_c + sum_j exp(s_j - lse) v_j,  lse = logsumexp(lse_c, s_1..s_k).
    Nothing of size (L x L) is kept for backward, let alone (L x L*K). GQA: query heads are
    grouped over their kv head. `window`: the causal block sees only the last `window` positions;
    `documents` [B, L] (packed rows): only its own document's.
    """
    if diag_k and q.device.type == "cpu":  # the CPU's flash kernel gives the log-sum-exp with the output
        mask = None if documents is None and window is None else step0_mask(q.shape[2], window, documents, q.device)
        with torch.autocast(q.device.type, enabled=False):
            return FlashDiagonalAttention.apply(q, k0, v0, torch.stack(diag_k), torch.stack(diag_v), mask)
    o_c = causal_attention(q, k0, v0, window, documents)
    if not diag_k:  # step 0 (or TTT 1): plain causal attention
        return o_c
    B, nh, L, d = q.shape
    nkv = k0.shape[1]
    with torch.autocast(q.device.type, enabled=False):  # the merge stays fp32 under bf16 autocast
        lse_c = CausalLogSumExp.apply(q.float(), k0.float(), chunk_size, window, documents).view(
            B, nkv, nh // nkv, L, 1)
        qg = q.float().view(B, nkv, nh // nkv, L, d)
        dk, dv = torch.stack(diag_k).float(), torch.stack(diag_v).float()  # [k, B, kv, L, d]
        diag = torch.einsum("bhgld,kbhld->bhglk", qg, dk) * d ** -0.5  # one dot product per position and step
        lse = torch.logsumexp(torch.cat([lse_c, diag], dim=-1), dim=-1, keepdim=True)
        out = torch.exp(lse_c - lse) * o_c.float().view(B, nkv, nh // nkv, L, d)
        out = out + torch.einsum("bhglk,kbhld->bhgld", torch.exp(diag - lse), dv)
    return out.reshape(B, nh, L, d).to(q.dtype)


class FlashDiagonalAttention(torch.autograd.Function):
    """`diagonal_ttt_attention` on the CPU in one flash-attention pass each way.

    Forward: the flash kernel's causal output o_c and its log-sum-exp lse_c (one fused call),
    the diagonal scores s_j, and out = a o_c + sum_j b_j v_j with a = exp(lse_c - lse),
    b_j = exp(s_j - lse). Backward: the whole softmax's score gradient on the causal block is
    a p_c (dO.v_s - dO.out); the kernel's backward computes exactly that when given the gradient
    a dO and the *merged* output (its row term is rowsum(grad * out) = a dO.out). The diagonal
    keys' gradients are element-wise. So no second attention pass, no (L x L) scores kept, where
    the log-sum-exp's own backward (`CausalLogSumExp`) needs two more in fp32."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k0: torch.Tensor, v0: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        B, nh, L, d = q.shape
        nkv = k0.shape[1]
        g = nh // nkv
        k0, v0 = k0.repeat_interleave(g, dim=1), v0.repeat_interleave(g, dim=1)  # the kernel wants equal heads
        if mask is not None:  # the kernel takes an additive mask of the query's dtype
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill_(~mask, float("-inf"))
        o_c, lse_c = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k0, v0, 0.0, mask is None,
                                                                               attn_mask=mask)
        qg = q.float().view(B, nkv, g, L, d)
        diag = torch.einsum("bhgld,kbhld->bhglk", qg, dk.float()) * d ** -0.5
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
            grad_c, q, k0, v0, out, lse_c, 0.0, mask is None, attn_mask=mask)
        row = (gf * out.float().view(B, nkv, g, L, d)).sum(-1, keepdim=True)  # dO.out per query
        ds = b * (torch.einsum("bhgld,kbhld->bhglk", gf, dv.float()) - row)  # the diagonal scores' gradients
        dq = dq.float().view(B, nkv, g, L, d) + scale * torch.einsum("bhglk,kbhld->bhgld", ds, dk.float())
        qg = q.float().view(B, nkv, g, L, d)
        ddk = scale * torch.einsum("bhglk,bhgld->kbhld", ds, qg)
        ddv = torch.einsum("bhglk,bhgld->kbhld", b, gf)
        return (dq.reshape(B, nh, L, d).to(q.dtype), dk0.view(B, nkv, g, L, d).sum(2).to(k0.dtype),
                dv0.view(B, nkv, g, L, d).sum(2).to(v0.dtype), ddk.to(dk.dtype), ddv.to(dv.dtype), None)


class DiagonalTTTAttention:
    """The efficient TTT attention core: keeps step-0 keys and the per-step diagonal keys."""

    def __init__(self, chunk_size: int = DEFAULT_QUERY_CHUNK, window: int | None = None,
                 documents: torch.Tensor | None = None) -> None:
        self.chunk_size, self.window, self.documents = chunk_size, window, documents
        self.k0: torch.Tensor | None = None
        self.v0: torch.Tensor | None = None
        self.diag_k: list[torch.Tensor] = []
        self.diag_v: list[torch.Tensor] = []

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.k0 is None:
            self.k0, self.v0 = k, v
        else:
            self.diag_k.append(k)
            self.diag_v.append(v)
        return diagonal_ttt_attention(q, self.k0, self.v0, self.diag_k, self.diag_v, self.chunk_size, self.window,
                                      self.documents)


class Attention(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        in_dim = 2 * cfg.hidden_size  # concat(embedding, hidden)
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(in_dim, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(in_dim, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, core: TTTAttentionCore) -> torch.Tensor:
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.num_kv_heads, self.head_dim).transpose(1, 2)
        out = core(apply_rope(q, cos, sin), apply_rope(k, cos, sin), v)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    """The one decoder layer: attention over concat(norm(embedding), norm(hidden)), residual = hidden."""

    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.norm_before_residual = cfg.norm_before_residual
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, hidden: torch.Tensor, embeds: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                core: TTTAttentionCore) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        h = self.residual(hidden, normed) + self.self_attn(x, cos, sin, core)
        return h + self.mlp(self.post_attention_layernorm(h))

    def residual(self, hidden: torch.Tensor, normed: torch.Tensor) -> torch.Tensor:
        return normed if self.norm_before_residual else hidden


# ---------------------------------------------------------------------------------------------
# The drafter
# ---------------------------------------------------------------------------------------------

def shift_left(x: torch.Tensor, n: int, fill: float | int | bool = 0) -> torch.Tensor:
    """x[:, t + n] at position t along dim 1, `fill` past the end (teacher forcing n tokens ahead)."""
    if n == 0:
        return x
    pad = x.new_full((x.shape[0], min(n, x.shape[1]), *x.shape[2:]), fill)
    return torch.cat([x[:, n:], pad], dim=1)


@dataclass
class DraftOutput:
    """Per TTT step k, the final norm's output [B, L, H]: position t predicts token t + k + 2.

    The LM head is applied where it is needed: training's loss applies it only at the
    positions that count (the head and the softmax over the draft vocabulary are most of a
    step's work), `logits` everywhere."""

    hidden: list[torch.Tensor]
    head: Callable[[torch.Tensor], torch.Tensor]

    @property
    def logits(self) -> list[torch.Tensor]:
        return [self.head(h) for h in self.hidden]


class Eagle3Draft(nn.Module):
    def __init__(self, cfg: DraftConfig):
        super().__init__()
        self.config = cfg
        H = cfg.hidden_size
        self.embed_tokens = nn.Embedding(cfg.target_vocab_size, H)
        self.embed_tokens.weight.requires_grad_(False)  # copied from the target, frozen
        if cfg.fc_norm:
            self.fc_norm = RMSNorm(3 * cfg.target_hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(3 * cfg.target_hidden_size, H, bias=False)
        self.midlayer = MidLayer(cfg)
        self.norm = RMSNorm(H, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(H, cfg.draft_vocab_size, bias=False)
        d2t, t2d = build_draft_vocab({}, cfg.target_vocab_size, cfg.draft_vocab_size)
        self.register_buffer("d2t", d2t)
        self.register_buffer("t2d", t2d)
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02) -> None:
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, RMSNorm):
                nn.init.ones_(m.weight)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target_ids(self) -> torch.Tensor:
        return torch.arange(self.config.draft_vocab_size, device=self.d2t.device) + self.d2t

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """g = fc(concat aux), the step-0 hidden input."""
        if self.config.fc_norm:
            aux_hidden = self.fc_norm(aux_hidden)
        return self.fc(aux_hidden.to(self.fc.weight.dtype))

    def forward(self, input_ids: torch.Tensor, aux_hidden: torch.Tensor, steps: int = DEFAULT_TTT_STEPS,
                attention: Callable[[], TTTAttentionCore] = DiagonalTTTAttention,
                documents: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> DraftOutput:
        """Unroll `steps` TTT steps over right-padded sequences, or over packed rows.

        input_ids [B, L] are the sample's tokens; aux_hidden [B, L, 3H] the target's aux states at
        the same positions. At step k, position t gets token t+1+k and RoPE position t+k, and
        predicts token t+k+2. Packed rows hold several samples one after another: `documents`
        [B, L] numbers each position's sample (attention stays within it) and `positions` [B, L]
        counts from 0 at each sample's start (its RoPE positions, as if it were alone). Positions
        whose shifted token comes from the next sample are garbage that no counted position sees
        (they are the last of their sample, whose targets lie past its end: the loss skips them).
        """
        L = input_ids.shape[1]
        core = attention()
        core.window, core.documents = self.config.sliding_window, documents
        if positions is None:
            positions = torch.arange(L, device=input_ids.device)
        hidden = self.fuse(aux_hidden)
        outputs = []
        for k in range(steps):
            embeds = self.embed_tokens(shift_left(input_ids, 1 + k))
            cos, sin = rope_cos_sin(positions + k, self.config.head_dim, self.config.rope_theta)
            if cos.dim() == 3:  # per-row positions [B, L, d]: broadcast over heads
                cos, sin = cos[:, None], sin[:, None]
            out = self.midlayer(hidden, embeds.to(hidden.dtype), cos, sin, core)
            normed = self.norm(out)
            outputs.append(normed)
            hidden = normed if self.config.norm_output else out
        return DraftOutput(outputs, self.lm_head)


def load_embeddings_from(draft: Eagle3Draft, target_embeddings: torch.Tensor) -> None:
    with torch.no_grad():
        draft.embed_tokens.weight.copy_(target_embeddings.to(draft.embed_tokens.weight.dtype))


# ---------------------------------------------------------------------------------------------
# Teacher and loss
# ---------------------------------------------------------------------------------------------

@dataclass
class Teacher:
    """The target's distribution at each position, restricted to the draft vocabulary.

    Dense (`ids` None): log-probabilities over the whole draft vocabulary. Sparse: only the
    teacher's `top_k` draft ids, their log-probabilities renormalised over those k, which is
    what a stored or cached teacher keeps (k = 1 is the hard label)."""

    log_probs: torch.Tensor  # [B, L, Vd] dense, or [B, L, k] sparse; fp32 (a cache may hold fp16)
    argmax: torch.Tensor  # [B, L] draft id of the target's argmax among draft ids
    in_draft: torch.Tensor  # [B, L] bool: the target's full-vocab argmax is in the draft vocab
    ids: torch.Tensor | None = None  # [B, L, k] draft ids of a sparse teacher
    features: torch.Tensor | None = None  # [B, L, H] final_norm(h_N): the feature-regression target

    @property
    def top_k(self) -> int | None:
        return None if self.ids is None else self.ids.shape[-1]


class DraftFirstHead(nn.Module):
    """The target's LM head with its rows reordered, the draft ids first: one product gives the
    draft-vocabulary logits as a contiguous block and the rest's maximum, which says whether the
    target's argmax is drafted, without gathering draft columns out of a [T, vocab] tensor or an
    argmax over all of it (on a CPU those took more time than the product). Build it once."""

    def __init__(self, lm_head: nn.Module, d2t: torch.Tensor, t2d: torch.Tensor, dtype: torch.dtype | None = None):
        super().__init__()
        weight = lm_head.weight.detach()
        draft_ids = torch.arange(d2t.shape[0], device=d2t.device) + d2t
        rest = (~t2d).nonzero().squeeze(-1)
        self.register_buffer("weight", torch.cat([weight[draft_ids], weight[rest]]).to(dtype or weight.dtype))
        self.draft_size = d2t.shape[0]

    def forward(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(draft logits fp32 [..., Vd], max logit over the other ids [...] (-inf when none))."""
        logits = F.linear(normed.to(self.weight.dtype), self.weight)
        draft = logits[..., :self.draft_size].float()
        if logits.shape[-1] == self.draft_size:
            return draft, torch.full(draft.shape[:-1], float("-inf"), device=draft.device)
        return draft, logits[..., self.draft_size:].amax(-1).float()


@torch.no_grad()
def make_teacher(last_hidden: torch.Tensor, final_norm: nn.Module, lm_head: nn.Module, d2t: torch.Tensor,
                 t2d: torch.Tensor, top_k: int | None = None, features: bool = False) -> Teacher:
    """`lm_head(final_norm(h_N))` of the frozen target from the stored pre-norm last state;
    dense, or sparse with the `top_k` most likely draft ids. `lm_head` is the target's head, or
    its `DraftFirstHead` made once (the same numbers, faster). The target's argmax counts as
    drafted when the best draft logit is at least every other one (an exact tie, vanishingly
    rare, counts as drafted)."""
    head = lm_head if isinstance(lm_head, DraftFirstHead) else DraftFirstHead(lm_head, d2t, t2d)
    normed = final_norm(last_hidden.to(head.weight.dtype))
    draft, rest_max = head(normed)
    in_draft = draft.amax(-1) >= rest_max
    log_probs = torch.log_softmax(draft, dim=-1)
    del draft
    feats = normed if features else None
    if top_k is None or top_k >= d2t.shape[0]:
        return Teacher(log_probs, log_probs.argmax(-1), in_draft, features=feats)
    top, ids = log_probs.topk(top_k, dim=-1)
    return Teacher(top - torch.logsumexp(top, dim=-1, keepdim=True), ids[..., 0], in_draft, ids, feats)


@torch.no_grad()
def target_top_k(last_hidden: torch.Tensor, final_norm: nn.Module, lm_head: nn.Module, k: int,
                 chunk: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids int32 [T, k], log-probabilities fp16 [T, k]) of the target's k most likely next tokens
    over its whole vocabulary, most likely first: the teacher a compact dataset stores. Computed
    as `make_teacher` computes it, a chunk of positions at a time (no [T, vocab] tensor)."""
    ids, log_probs = [], []
    dtype = lm_head.weight.dtype
    for part in last_hidden.split(chunk):
        logits = lm_head(final_norm(part.to(dtype))).float()
        top, idx = logits.topk(k, dim=-1)  # log_softmax of the k only: no second [chunk, vocab] tensor
        ids.append(idx.to(torch.int32))
        log_probs.append((top - torch.logsumexp(logits, dim=-1, keepdim=True)).to(torch.float16))
    return torch.cat(ids), torch.cat(log_probs)


def teacher_from_top_k(ids: torch.Tensor, log_probs: torch.Tensor, d2t: torch.Tensor, t2d: torch.Tensor,
                       top_k: int) -> Teacher:
    """The sparse teacher `make_teacher(top_k=...)` gives, from a stored full-vocabulary top-K
    (`ids` [B, L, K] target ids, most likely first): the first `top_k` of them that are draft ids,
    renormalised over those. Equal to the teacher computed from the last state whenever the
    stored K hold the `top_k` most likely draft ids (renormalising cancels the two softmaxes'
    different denominators); the argmax and whether it is drafted are always exact."""
    draft_index = torch.full((t2d.shape[0],), -1, dtype=torch.long, device=ids.device)
    draft_index[torch.arange(d2t.shape[0], device=ids.device) + d2t] = torch.arange(d2t.shape[0], device=ids.device)
    dids = draft_index[ids.long()]  # [B, L, K], -1 where the token is not drafted
    keep = dids >= 0
    rank = keep.long().cumsum(-1) - 1
    keep &= rank < top_k
    out_ids = torch.zeros(*ids.shape[:-1], top_k, dtype=torch.long, device=ids.device)
    out_lp = torch.full(out_ids.shape, float("-inf"), device=ids.device)
    b, l, j = keep.nonzero(as_tuple=True)  # each kept entry goes to its rank among the kept
    out_ids[b, l, rank[b, l, j]] = dids[b, l, j]
    out_lp[b, l, rank[b, l, j]] = log_probs[b, l, j].float()
    none = ~keep.any(-1)  # no drafted token among the stored K: the target's argmax is not drafted either
    out_lp[..., 0] = torch.where(none, 0.0, out_lp[..., 0])
    out_lp = out_lp - torch.logsumexp(out_lp, dim=-1, keepdim=True)
    return Teacher(out_lp, out_ids[..., 0], t2d[ids[..., 0].long()], out_ids)


@dataclass
class StepStats:
    """Sums over counted positions, so micro-batches and processes add up exactly. Accuracy
    counts every position the loss looks at, a miss where the target's choice is not drafted
    (so it is the acceptance rate, whatever the draft vocabulary's size); the loss averages
    only where it is drafted."""

    loss_sum: torch.Tensor  # [K] soft cross-entropy summed over drafted positions
    correct: torch.Tensor  # [K] top-1 matches of the target's argmax
    count: torch.Tensor  # [K] counted positions
    loss_count: torch.Tensor  # [K] of them, those where the target's argmax is drafted

    def as_tensor(self) -> torch.Tensor:
        return torch.stack([self.loss_sum, self.correct, self.count, self.loss_count])


STAT_ROWS = 4


def step_weights(steps: int, decay: float = STEP_WEIGHT_DECAY) -> list[float]:
    return [decay ** k for k in range(steps)]


def acceptance_length(acc: list[float]) -> float:
    """Simulated acceptance length sum_k prod_{i<=k} acc_i (tokens accepted per draft chain)."""
    total, run = 0.0, 1.0
    for a in acc:
        run *= a
        total += run
    return total


def soft_cross_entropy(logits: torch.Tensor, log_probs: torch.Tensor, ids: torch.Tensor | None) -> torch.Tensor:
    """-sum_i p_i log q_i per row, as logsumexp(z) - <p, z> (sum p = 1): no log-softmax copy of
    the logits is kept. `ids` picks the logits a sparse teacher's probabilities belong to."""
    z = logits.float()
    picked = z if ids is None else z.gather(-1, ids.long())
    return torch.logsumexp(z, dim=-1) - (log_probs.float().exp() * picked).sum(-1)


LK_HYBRID_ETA = 3.0  # the LK paper's best hybrid setting: the blend leaves KL for TV as the overlap grows
OVERLAP_FLOOR = 1e-5  # -log(overlap) stays finite where the drafter and the target do not overlap


def objective_loss(logits: torch.Tensor, log_probs: torch.Tensor, ids: torch.Tensor | None,
                   objective: str) -> torch.Tensor:
    """Per-row loss of draft logits [N, Vd] against the teacher's log-probabilities (dense [N, Vd],
    or sparse [N, k] over draft ids `ids`):
    - "ce": soft cross-entropy -sum p log q (KL(p || q) plus the teacher's entropy);
    - "lk": -log alpha, alpha = sum_v min(p_v, q_v) the acceptance rate of sampled speculative
      decoding (LK losses, Samarin et al. 2026: its gradient is TV's, scaled by 1 / alpha, so it
      learns from a cold start);
    - "lk-hybrid": lambda KL(p || q) + (1 - lambda) (1 - alpha), lambda = exp(-3 sg(alpha)).
    A sparse teacher puts no mass outside its k ids, so alpha and KL are sums over those k."""
    if objective == "ce":
        return soft_cross_entropy(logits, log_probs, ids)
    z = logits.float()
    log_q = (z if ids is None else z.gather(-1, ids.long())) - torch.logsumexp(z, dim=-1, keepdim=True)
    p = log_probs.float().exp()
    overlap = torch.minimum(p, log_q.exp()).sum(-1)
    if objective == "lk":
        return -torch.log(overlap.clamp_min(OVERLAP_FLOOR))
    kl = torch.where(p > 0, p * (log_probs.float() - log_q), 0.0).sum(-1)
    weight = torch.exp(-LK_HYBRID_ETA * overlap.detach())
    return weight * kl + (1 - weight) * (1 - overlap)


def ttt_loss(out: DraftOutput, teacher: Teacher, positions: torch.Tensor, decay: float = STEP_WEIGHT_DECAY,
             feature_weight: float = 0.0, documents: torch.Tensor | None = None,
             objective: str = "ce") -> tuple[torch.Tensor, StepStats]:
    """Sum over steps of decay^k * mean soft cross-entropy vs the target, and per-step sums.

    Step k at position t predicts token t+k+2 from the target's distribution at position t+k+1.
    It counts when `positions` [B, L] marks that token (the loss mask: assistant tokens; or every
    real token); the loss uses it when the target's argmax is drafted. The LM head runs on
    counted positions only. `feature_weight` adds EAGLE-1's regression of the target's next
    last-layer state: smooth L1 between the drafter's normed output and final_norm(h_N) at t+k+1.
    In packed rows (`documents` [B, L]) a position counts only when t+k+2 is in its own sample.
    `objective` is what each position minimises (`objective_loss`); accuracy is counted alike.
    """
    total = positions.new_zeros((), dtype=torch.float32)
    loss_sum, correct, count, loss_count = [], [], [], []
    L = positions.shape[1]
    for k, hidden in enumerate(out.hidden):
        n_pos = max(0, L - k - 2)  # positions whose predicted token (t+k+2) is inside the sequence
        sel = positions[:, k + 2:].bool()  # [B, n_pos]
        if documents is not None:  # the predicted token must be of the same sample
            sel = sel & (documents[:, k + 2:] == documents[:, :n_pos])
        h = hidden[:, :n_pos][sel]  # [N, H] the counted positions only

        def teacher_at(x: torch.Tensor) -> torch.Tensor:  # the teacher's rows for them (t+k+1)
            return x[:, k + 1: k + 1 + n_pos][sel]

        drafted = teacher_at(teacher.in_draft)
        logits = out.head(h)
        ce = objective_loss(logits, teacher_at(teacher.log_probs),
                            None if teacher.ids is None else teacher_at(teacher.ids), objective)
        n = drafted.sum()
        step_sum = (ce * drafted).sum()
        step_loss = step_sum / n.clamp(min=1)
        if feature_weight and teacher.features is not None:
            target = teacher_at(teacher.features).float()
            step_loss = step_loss + feature_weight * F.smooth_l1_loss(h.float(), target, reduction="none").mean(-1).mean()
        total = total + (decay ** k) * step_loss
        with torch.no_grad():
            hit = (logits.argmax(-1) == teacher_at(teacher.argmax)) & drafted
        loss_sum.append(step_sum.detach())
        correct.append(hit.sum().float())
        count.append(torch.tensor(float(h.shape[0]), device=positions.device))
        loss_count.append(n.float())
    return total, StepStats(*(torch.stack(x) for x in (loss_sum, correct, count, loss_count)))


def stats_summary(sums: torch.Tensor) -> dict[str, Any]:
    """Per-step loss/acc and tau from a [4, K] tensor of (loss_sum, correct, count, loss_count)."""
    loss_sum, correct, count, loss_count = (sums[i].tolist() for i in range(STAT_ROWS))
    loss = [ls / c if c else None for ls, c in zip(loss_sum, loss_count)]  # None: no position to average (JSON null)
    acc = [cr / c if c else 0.0 for cr, c in zip(correct, count)]
    drafted = [lc / c if c else 0.0 for lc, c in zip(loss_count, count)]
    return {"loss": loss, "acc": acc, "tau": acceptance_length(acc), "positions": count, "drafted": drafted}


def num_parameters(model: nn.Module, trainable_only: bool = True) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


__all__ = ["DraftConfig", "Eagle3Draft", "DiagonalTTTAttention", "DraftOutput", "Teacher", "StepStats",
           "build_draft_vocab", "diagonal_ttt_attention", "make_teacher", "target_top_k", "teacher_from_top_k",
           "ttt_loss", "soft_cross_entropy",
           "acceptance_length",
           "stats_summary", "step_weights", "shift_left", "load_embeddings_from"]

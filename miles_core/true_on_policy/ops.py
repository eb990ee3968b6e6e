"""Invariant kernels: functions whose value for one row does not depend on the other rows of the
call, on how many there are, or on how many keys a row attends to, so an engine's KV-cached
decode, its batched prefill and the trainer's full forward compute the same bits.

What makes an op on CPU depend on its batch, and what these kernels do instead:

- GEMMs (MKL, oneDNN) pick kernels and K blockings by shape, so one row's dot products change
  with M. `dot` by a weight (a linear layer) runs GEMMs of one fixed shape, `ROW_BLOCK` rows
  each; by a batched operand (attention) it computes every output as a product, then a sum
  over the contiguous last dim, which ATen reduces serially per output in an order that
  depends on the reduced length alone.
- Elementwise transcendental functions (`exp`, `log`, `sigmoid`) run vectorised (SLEEF) in the
  body of a loop and scalar (libm) in its tail, and where a loop's tail falls depends on the
  tensor's size and the thread split. `exp` and `log` here are built from IEEE `+ - * /`, which
  every path rounds the same, plus exact bit manipulation, and `sigmoid`, `silu` and the
  softmaxes from them.
- A softmax over a row of keys sums over the row's length: `attention` sums over fixed chunks
  of absolute positions, in order, masked positions exact zeros, so a row of t keys and the
  same row inside a T-key forward give the same sums.

An op with a forward of its own (`dot`, `exp`, the softmaxes, `sigmoid`, `silu`) is an autograd
function whose backward is the usual formula (gradients need not be invariant); the rest are
compositions of those and of exact ops.
"""

from __future__ import annotations

import torch

# the product a·b of one call is materialised in pieces of at most this many elements
PIECE_ELEMENTS = 1 << 22
# attention sums over keys in chunks of this many absolute positions
KEY_CHUNK = 64
# a linear layer runs its rows in GEMMs of this many rows each
ROW_BLOCK = 32

_LOG2E = 1.4426950408889634
_LN2_HI = 0.693145751953125  # ln 2 in its leading bits: n·_LN2_HI is exact for |n| < 2^9
_LN2_LO = 1.4286068203094172e-06
_EXP_MIN = -87.0  # below: 0 (and -inf → 0), the masked entries of a softmax
_EXP_MAX = 88.0


def _rows_times(a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """a [..., K] @ wᵀ (w [N, K]) in blocks of `ROW_BLOCK` rows (the last zero-padded), one GEMM
    of one fixed shape per block: the library makes the same choices for every call, and a
    row's outputs are its own K-long dot products, reduced in the kernel's fixed order whatever
    rows share its block."""
    k, n = w.shape[1], w.shape[0]
    rows = a.reshape(-1, k)
    count = rows.shape[0]
    pad = -count % ROW_BLOCK
    if pad:
        rows = torch.cat([rows, rows.new_zeros(pad, k)])
    wt = w.t()
    blocks = [rows[r : r + ROW_BLOCK] @ wt for r in range(0, rows.shape[0], ROW_BLOCK)]
    return torch.cat(blocks)[:count].view(*a.shape[:-1], n)


def _dot_forward(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """out[..., i, j] = Σ_k a[..., i, k]·b[..., j, k] (b 2-D, or batched as a)."""
    if b.dim() == 2:
        return _rows_times(a, b)
    rows = a.shape[-2]
    per_row = b.shape[-2] * a.shape[-1] * max(a[..., :1, :1].numel(), b[..., :1, :1].numel())
    step = max(1, PIECE_ELEMENTS // max(1, per_row))
    if rows <= step:
        return (a.unsqueeze(-2) * b.unsqueeze(-3)).sum(-1)
    parts = [
        (a[..., r : r + step, :].unsqueeze(-2) * b.unsqueeze(-3)).sum(-1)
        for r in range(0, rows, step)
    ]
    return torch.cat(parts, dim=-2)


class _Dot(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        return _dot_forward(a, b)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        a, b = ctx.saved_tensors
        grad_a = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_a = grad @ b
        if ctx.needs_input_grad[1]:
            grad_b = grad.transpose(-1, -2) @ a
            while grad_b.dim() > b.dim():  # b was broadcast over a's leading dims
                grad_b = grad_b.sum(0)
        return grad_a, grad_b


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ bᵀ over the last dim, each output element a fixed-order sum of its own products:
    a [..., M, K], b [N, K] or [..., N, K] → [..., M, N]. `linear(x, W)` is `dot(x, W)`."""
    if a.shape[-1] != b.shape[-1]:
        raise ValueError(f"dot: inner sizes differ, {tuple(a.shape)} and {tuple(b.shape)}")
    return _Dot.apply(a.contiguous(), b.contiguous())


def _exp_values(x: torch.Tensor) -> torch.Tensor:
    """e^x in float32 from IEEE arithmetic alone: x = n·ln2 + r, |r| ≤ ln2/2 (Cody–Waite), e^r
    by a degree-7 Taylor polynomial, 2^n built from its exponent bits. Within 2 ulp."""
    x = x.float()
    low = x < _EXP_MIN
    x = x.clamp(_EXP_MIN, _EXP_MAX)
    n = torch.round(x * _LOG2E)
    r = (x - n * _LN2_HI) - n * _LN2_LO
    p = r * (1.0 / 5040) + (1.0 / 720)
    for c in (1.0 / 120, 1.0 / 24, 1.0 / 6, 0.5, 1.0, 1.0):
        p = p * r + c
    scale = ((n.to(torch.int32) + 127) << 23).view(torch.float32)
    return torch.where(low, torch.zeros_like(p), p * scale)


class _Exp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = _exp_values(x)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        return grad * out


def exp(x: torch.Tensor) -> torch.Tensor:
    """e^x (float32), the same bits for an element wherever it sits in any tensor."""
    return _Exp.apply(x)


def _log_values(x: torch.Tensor) -> torch.Tensor:
    """ln x for x > 0 (float32) from IEEE arithmetic: x = m·2^e with m in [√½, √2),
    ln m = 2·atanh((m − 1)/(m + 1)) by its series to s¹¹. Within 2 ulp."""
    m, e = torch.frexp(x.float())
    small = m < 0.7071067811865476
    m = torch.where(small, m * 2.0, m)
    e = (e - small.to(e.dtype)).float()
    s = (m - 1.0) / (m + 1.0)
    s2 = s * s
    p = s2 * (1.0 / 11) + (1.0 / 9)
    for c in (1.0 / 7, 1.0 / 5, 1.0 / 3, 1.0):
        p = p * s2 + c
    return e * _LN2_HI + (e * _LN2_LO + 2.0 * s * p)


def _exp_sum(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e^(x − max), its sum) over the last dim, masked entries exact zeros."""
    if mask is not None:
        x = x.masked_fill(~mask, float("-inf"))
    top = x.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a fully masked row
    e = _exp_values(x - top)
    return e, e.sum(-1, keepdim=True)


class _LogSoftmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        top = x.amax(-1, keepdim=True)
        _, total = _exp_sum(x, None)
        out = (x - top) - _log_values(total)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        return grad - out.exp() * grad.sum(-1, keepdim=True)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """log_softmax over the last dim (float32), invariant per row."""
    return _LogSoftmax.apply(x)


def tempered_log_softmax(logits: torch.Tensor, temperature: float | torch.Tensor) -> torch.Tensor:
    """log_softmax(logits / temperature) over the last dim, the engine's and the trainer's
    alike: logits in float32 divided by a float32 tensor (one temperature, or one per row of
    `logits`' leading dims), never by a scalar (which a kernel may turn into a product with its
    reciprocal)."""
    t = torch.as_tensor(temperature, dtype=torch.float32, device=logits.device)
    t = t.reshape(*t.shape, *([1] * (logits.dim() - t.dim())))
    return log_softmax(logits.float() / t.expand(*logits.shape[:-1], 1))


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        e, total = _exp_sum(x.float(), None)
        out = e / total
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        return out * (grad - (grad * out).sum(-1, keepdim=True))


def softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax over the last dim (float32), invariant per row (a router's over its experts)."""
    return _Softmax.apply(x)


class _Sigmoid(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        out = 1.0 / (1.0 + _exp_values(-x.float()))
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (out,) = ctx.saved_tensors
        return grad * out * (1 - out)


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + e^−x), elementwise, the same bits wherever an element sits."""
    return _Sigmoid.apply(x)


class _Silu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x / (1.0 + _exp_values(-x))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (x,) = ctx.saved_tensors
        s = torch.sigmoid(x)
        return grad * s * (1 + x * (1 - s))


def silu(x: torch.Tensor) -> torch.Tensor:
    """x·σ(x), elementwise, the same bits wherever an element sits."""
    return _Silu.apply(x)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x / √(mean(x²) + ε) · weight over the last dim: a sum over the row, IEEE √ and /."""
    x = x.float()
    var = (x * x).sum(-1, keepdim=True) / x.shape[-1]
    return weight * (x / torch.sqrt(var + eps))


def rope_table(positions: int, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [positions, head_dim] of rotary embeddings (halves repeated, as HF's
    `rotate_half` expects), computed one position at a time: a table of the same size has the
    same bits in every process, whatever its thread count."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    cos = torch.empty(positions, head_dim)
    sin = torch.empty(positions, head_dim)
    for p in range(positions):
        angle = inv_freq * float(p)
        angle = torch.cat([angle, angle])
        cos[p] = angle.cos()
        sin[p] = angle.sin()
    return cos, sin


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x·cos + rotate_half(x)·sin (x [..., T, hd]; cos, sin [T, hd] or broadcastable)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax(q·kᵀ·scale) v over keys laid out by absolute position.

    q [B, H, Tq, hd]; k, v [B, H, Lk, hd] with key j at position j, Lk a multiple of
    `KEY_CHUNK`; allowed [B, Tq, Lk]: which keys each query sees. The sums over keys run over
    fixed chunks of absolute positions [c·S, (c + 1)·S), added chunk by chunk in order, so a
    query's result does not depend on Lk: chunks past its last key add exact zeros, and a
    one-token decode over its own prefix equals its row of a full forward."""
    lk = k.shape[-2]
    if lk % KEY_CHUNK:
        raise ValueError(f"attention: {lk} keys, not a multiple of {KEY_CHUNK}")
    scores = (dot(q, k) * scale).masked_fill(~allowed.unsqueeze(1), float("-inf"))
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # nothing allowed
    e = exp(scores - top)
    chunks = [slice(c, c + KEY_CHUNK) for c in range(0, lk, KEY_CHUNK)]
    total = e[..., chunks[0]].sum(-1, keepdim=True)
    for c in chunks[1:]:
        total = total + e[..., c].sum(-1, keepdim=True)
    p = e / torch.where(total > 0, total, torch.ones_like(total))
    vt = v.transpose(-1, -2)
    out = dot(p[..., chunks[0]], vt[..., chunks[0]])
    for c in chunks[1:]:
        out = out + dot(p[..., c], vt[..., c])
    return out


def padded_keys(n: int) -> int:
    """The key-axis length `attention` takes for keys at positions [0, n)."""
    return -(-n // KEY_CHUNK) * KEY_CHUNK

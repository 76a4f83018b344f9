"""Rotary position embedding (RoPE) in Llama's layout, and `Rope`: the rotation of one forward call.

Attention cores get q and k unrotated and rotate them through a `Rope`, so a core may keep keys in
another frame (ANN attention keeps retrieved keys at capped distances, model/ann_attention.py).
"""

import torch


def rope_cos_sin(positions, head_dim, theta, dtype):
    """positions (b, s) -> cos, sin (b, 1, s, d), Llama's layout (frequencies repeated twice).

    Angles are computed in float32 as Llama does, or in float64 for a float64 model.
    """
    angle_dtype = torch.promote_types(dtype, torch.float32)
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=positions.device, dtype=angle_dtype) / head_dim))
    freqs = positions.to(angle_dtype)[..., None] * inv_freq
    angles = torch.cat((freqs, freqs), dim=-1)[:, None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x):
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def apply_rope(x, cos, sin):
    return x * cos + rotate_half(x) * sin


def rolled_sin(sin):
    """sin (..., d) -> the table with which a roll replaces rotate_half: rotate_half(x) * sin equals
    x.roll(d/2, -1) * rolled_sin(sin)."""
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def apply_rope_rolled(x, cos, signed_sin):
    """apply_rope with rolled_sin's table: three kernels instead of six, for the one-token decode
    path, where each kernel's launch costs more than its arithmetic."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)


class Rope:
    """The rotary embedding of one forward call: rotates the new tokens, or any positions on demand.

    Attention cores get q and k unrotated, so a core may store keys in another frame (ANN attention
    keeps retrieved keys at capped distances, model/ann_attention.py).
    """

    def __init__(self, positions, head_dim, theta, dtype, cos_sin=None):
        self.positions, self.head_dim, self.theta, self.dtype = positions, head_dim, theta, dtype
        self.cos, self.sin = cos_sin or rope_cos_sin(positions, head_dim, theta, dtype)

    def slice(self, begin, end):
        """The Rope of new tokens begin .. end-1 of this one's, sharing its cos/sin."""
        cos_sin = (self.cos[:, :, begin:end], self.sin[:, :, begin:end])
        return Rope(self.positions[:, begin:end], self.head_dim, self.theta, self.dtype, cos_sin)

    def moved(self, positions):
        """The Rope of other positions (b, s) with this one's frequencies."""
        return Rope(positions, self.head_dim, self.theta, self.dtype)

    def __call__(self, x):
        """x (b, heads, s, d) of the new tokens, rotated at their positions."""
        return apply_rope(x, self.cos, self.sin)

    def at(self, x, positions):
        """x (b, ..., s, d) rotated at positions (b, s)."""
        cos, sin = rope_cos_sin(positions, self.head_dim, self.theta, self.dtype)
        shape = (cos.shape[0],) + (1,) * (x.dim() - 3) + cos.shape[-2:]
        return apply_rope(x, cos.view(shape), sin.view(shape))

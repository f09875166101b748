"""Kernels: each Triton kernel beside the few-line PyTorch reference that documents it.

Dispatch: the Triton kernel on CUDA tensors, the reference on CPU tensors, and the Triton kernel
on CPU when TRITON_INTERPRET=1 is set (the tests)."""
import torch
import torch.nn.functional as F

# ---------------------------------------------------------------- attention


def prefill_attention(q, k, v, scale):
    """Causal attention over one prompt. q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]."""
    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                         is_causal=True, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)


def particle_attention_ref(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale):
    """Attention for R requests x N particles x T new tokens.

    q [R, N, T, Hq, D]; prefix_k/v [R, Hkv, P, D] (the prompt, shared by all particles);
    suffix_k/v [R, N, Hkv, S, D] (each particle's generated tokens, the T new ones already written
    at suffix_len .. suffix_len+T-1); prefix_len, suffix_len: int32 [R].
    Query t sees prefix keys [0, prefix_len) and suffix keys [0, suffix_len + t]. -> [R, N, T, Hq, D].
    Scores against the prefix broadcast over particles, so the prompt is never copied N times."""
    R, N, T, Hq, D = q.shape
    Hkv = prefix_k.shape[1]
    out = torch.empty_like(q)
    for r in range(R):
        P, S = int(prefix_len[r]), int(suffix_len[r]) + T
        qr = q[r].view(N, T, Hkv, Hq // Hkv, D).permute(0, 2, 3, 1, 4)  # [N, Hkv, G, T, D]
        kp, vp = prefix_k[r, :, None, :P], prefix_v[r, :, None, :P]  # [Hkv, 1, P, D]
        ks, vs = suffix_k[r, :, :, None, :S], suffix_v[r, :, :, None, :S]  # [N, Hkv, 1, S, D]
        scores = torch.cat([qr @ kp.transpose(-1, -2), qr @ ks.transpose(-1, -2)], -1).float() * scale
        causal = torch.arange(S, device=q.device)[None, :] > torch.arange(S - T, S, device=q.device)[:, None]
        scores[..., P:].masked_fill_(causal, float("-inf"))  # [N, Hkv, G, T, P+S]
        p = scores.softmax(-1).to(q.dtype)
        o = p[..., :P] @ vp + p[..., P:] @ vs  # [N, Hkv, G, T, D]
        out[r] = o.permute(0, 3, 1, 2, 4).reshape(N, T, Hq, D)
    return out


def particle_attention(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale):
    return particle_attention_ref(q, prefix_k, prefix_v, suffix_k, suffix_v, prefix_len, suffix_len, scale)

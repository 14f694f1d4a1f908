"""Triton kernel of ``hca_fold.hca_fold``: one program per BLOCK_D channels, which it owns for every query and every
sweep, so the sweeps need no synchronisation between programs. Sweep k reads the states of sweep k - 1 from one
half of a scratch buffer and writes the other half (the first sweep reads ``(v, s)``); the last sweep writes the
output."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _hca_fold_kernel(v_ptr, s_ptr, start_ptr, hit_ptr, query_ptr, stored_ptr, scratch_ptr, out_ptr,
                     N, D, SWEEPS, BLOCK_D: tl.constexpr):
    offs = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    W = 2 * D
    for k in range(SWEEPS):
        src = scratch_ptr + ((k + 1) % 2) * N * W  # sweep k - 1's states (sweep 0 reads v, s)
        dst = scratch_ptr + (k % 2) * N * W
        if k == SWEEPS - 1:
            dst = out_ptr
        for n in range(N):
            q = tl.load(query_ptr + n).to(tl.int64)
            h = tl.load(hit_ptr + n) != 0
            first = tl.load(start_ptr + n) != 0
            v = tl.load(v_ptr + n * D + offs, mask=mask, other=0.0)
            s = tl.load(s_ptr + n * D + offs, mask=mask, other=0.0)
            if h:
                if k == 0:
                    po = tl.load(v_ptr + q * D + offs, mask=mask, other=0.0)
                    pl = tl.load(s_ptr + q * D + offs, mask=mask, other=0.0)
                else:
                    po = tl.load(src + q * W + offs, mask=mask, other=0.0)
                    pl = tl.load(src + q * W + D + offs, mask=mask, other=0.0)
            else:
                po = tl.load(stored_ptr + n * W + offs, mask=mask, other=0.0)
                pl = tl.load(stored_ptr + n * W + D + offs, mask=mask, other=0.0)
            m = tl.maximum(pl, s)
            new_l = m + tl.log(1.0 + tl.exp(-tl.abs(pl - s)))
            new_o = po * tl.exp(pl - new_l) + v * tl.exp(s - new_l)
            if first:
                new_o = v
                new_l = s
            tl.store(dst + n * W + offs, new_o, mask=mask)
            tl.store(dst + n * W + D + offs, new_l, mask=mask)
        tl.debug_barrier()


def hca_fold_triton(v: torch.Tensor, s: torch.Tensor, start: torch.Tensor, hit: torch.Tensor, query: torch.Tensor,
                    stored: torch.Tensor, sweeps: int) -> torch.Tensor:
    n, d = v.shape
    v, s, stored = v.float().contiguous(), s.float().contiguous(), stored.float().contiguous()
    if sweeps <= 0 or n == 0:
        return torch.cat([v, s], dim=1)
    out = torch.empty((n, 2 * d), dtype=torch.float32, device=v.device)
    scratch = torch.empty((2, n, 2 * d), dtype=torch.float32, device=v.device)
    block_d = min(256, triton.next_power_of_2(d))
    _hca_fold_kernel[(triton.cdiv(d, block_d),)](
        v, s, start.to(torch.int8).contiguous(), hit.to(torch.int8).contiguous(), query.contiguous(), stored,
        scratch, out, n, d, int(sweeps), BLOCK_D=block_d, num_warps=4,
    )
    return out

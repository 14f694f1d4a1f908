"""The model's attention and compression go through ``sgl_kernel_ext.ops``, which picks the Triton kernels on a
GPU. Here the Triton path is forced on the CPU under Triton's interpreter (in a child process, so the interpreter
flag does not leak) and the model's logits, with its projections fused as the server runs it, must match the torch
path."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

CHILD = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, sys.argv[1])
    torch.set_num_threads(1)
    from support.tiny_v4 import prefill_decode_logits, randomize, tiny_config
    from sglang_tree_v4.checkpoint.fuse import fuse_projections
    from sglang_tree_v4.dsv4.config import DSV4Config
    from sglang_tree_v4.dsv4.model import DSV4Model

    model = DSV4Model(DSV4Config.from_dict(tiny_config(64, hca_ratio=8, window=8)), with_mtp=False).eval()
    randomize(model, seed=3)
    fuse_projections(model)  # as the server runs it
    prompt = torch.randint(0, 64, (27,), generator=torch.Generator().manual_seed(0))

    def logits(backend):
        os.environ["SGL_KERNEL_EXT_BACKEND"] = backend
        return prefill_decode_logits(model, prompt)

    ref, tri = logits("torch"), logits("triton")
    err = ((tri - ref).abs().max() / ref.abs().max()).item()
    print("rel_err", err)
    sys.exit(0 if err <= 1e-5 else 1)
""")


def test_model_logits_equal_on_the_triton_path():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", CHILD, str(Path(__file__).parent)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "rel_err" in proc.stdout

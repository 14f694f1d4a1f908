"""Checkpoints as the swap steps over the plain model: ``weights`` (the published and HF layouts, loading and
saving), ``swap`` (build on the meta device, swap in the modules the checkpoint keeps quantized),
``quantized_modules`` (FP8 block linears, FP4 experts; their formats are ``sgl_kernel_ext.weight_formats``) and
``tp`` (SGLang's parallel layers in place of ours, each rank reading only its slice)."""

"""The SGLang-facing model: ``sglang_model`` (our DeepSeek-V4 behind SGLang's model interface: forward batches,
the verify step, the fixed shapes of capture) and ``sglang_pool`` (the compressed state inside SGLang's hybrid
sliding-window KV pool)."""

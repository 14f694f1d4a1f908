"""Helpers for tests and benchmarks, not used by the server: ``launcher`` (real server processes), ``prompts``
(the evaluation datasets), ``runner`` (a per-request wrapper over the plain model) and ``offline`` (speculative
decoding without a server, the oracle for served accept lengths)."""

"""The embedded checkpoint ``models/tiny-v4``: loads through transformers (config + tokenizer, as SGLang's loader
does) and through ``checkpoint.weights``, keeps every V4 mechanism, and its incremental greedy decoding (prefill + one
token at a time over the slot store) reproduces the argmaxes of one full-sequence forward over the same tokens."""
from pathlib import Path

import pytest
import torch

MODEL = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"
pytestmark = pytest.mark.skipif(not (MODEL / "model.safetensors").exists(), reason="models/tiny-v4 not present")


def test_transformers_loads_config_and_tokenizer():
    from transformers import AutoConfig, AutoTokenizer
    cfg = AutoConfig.from_pretrained(MODEL)
    tok = AutoTokenizer.from_pretrained(MODEL)
    assert cfg.model_type == "deepseek_v4" and cfg.vocab_size == len(tok)
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text.startswith(tok.bos_token) and text.endswith("<|assistant|>")
    assert tok.decode(tok.encode("def f(x):\n    return x * 2", add_special_tokens=False)) == \
        "def f(x):\n    return x * 2"


def test_every_mechanism_and_size():
    from sglang_tree_v4.dsv4.config import CSA, HCA, SLIDING, DSV4Config
    cfg = DSV4Config.from_pretrained(str(MODEL))
    types = {cfg.layer_type(i) for i in range(cfg.num_layers)}
    assert types == {SLIDING, CSA, HCA} and any(cfg.hash_layers) and cfg.hc_mult > 1
    assert cfg.num_nextn_predict_layers == 1
    assert cfg.window < 100 and max(cfg.compress_ratios) <= 32  # boundaries inside a few-hundred-token chat
    assert (MODEL / "model.safetensors").stat().st_size <= 16 * 2 ** 20


def test_runner_greedy_matches_full_forward():
    from transformers import AutoTokenizer

    from sglang_tree_v4.checkpoint.weights import load_model
    from sglang_tree_v4.testing.runner import DSV4Runner
    model = load_model(str(MODEL))
    assert len(model.mtp) == 1
    tok = AutoTokenizer.from_pretrained(MODEL)
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Tom has 3 boxes with 12 pencils each. How many pencils does he have?"}],
        tokenize=False, add_generation_prompt=True), add_special_tokens=False)
    runner = DSV4Runner(model, num_slots=256, max_len=256, max_reqs=1)
    rid = runner.add_request()
    out = [int(runner.extend([rid], [prompt])[0].logits[-1].argmax())]
    for _ in range(23):
        out.append(int(runner.decode([rid], [out[-1]])[0].logits[0].argmax()))
    with torch.no_grad():
        full = model.forward_sequences(torch.tensor([prompt + out[:-1]])).logits[0]
    assert full[len(prompt) - 1:].argmax(-1).tolist() == out

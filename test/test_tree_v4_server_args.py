"""TREE_V4's startup validation: defaults, impossible budgets and wrong models fail naming the flag."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_tree_v4.speculative.server_args import (
    DEFAULT_DRAFT_TOKENS,
    TreeBudget,
    draft_score_temperature,
    max_tree_nodes,
    validate_budget,
    validate_model,
)
from sglang_tree_v4.testing import launcher as srv

EMBEDDED = Path(__file__).resolve().parents[1] / "models" / "tiny-v4"


def test_defaults_are_a_real_tree_and_chain_is_matched():
    budget = validate_budget(None, None, None)
    assert budget.draft_tokens == DEFAULT_DRAFT_TOKENS and budget.topk > 1
    assert validate_budget(6, 1, None) == TreeBudget(6, 1, 5)
    assert validate_budget(6, None, 5) == TreeBudget(6, 1, 5)


@pytest.mark.parametrize("d, k, s, flag", [
    (1, 2, 1, "--speculative-num-draft-tokens"), (65, 2, 4, "--speculative-num-draft-tokens"),
    (8, 0, 4, "--speculative-eagle-topk"), (8, 2, 8, "--speculative-num-steps"), (8, 2, 0, "--speculative-num-steps"),
    (8, 1, 3, "--speculative-num-draft-tokens"),
])
def test_impossible_budgets_name_the_flag(d, k, s, flag):
    with pytest.raises(ValueError, match=flag):
        validate_budget(d, k, s)


def test_capacity_bound():
    assert max_tree_nodes(1, 7) == 7 and max_tree_nodes(2, 4) == 14 and max_tree_nodes(4, 1) == 4


def test_model_checks(tmp_path):
    assert validate_model(str(EMBEDDED))["model_type"] == "deepseek_v4"
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="--model-path"):
        validate_model(str(tmp_path / "llama"))
    raw = json.loads((EMBEDDED / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 0
    (tmp_path / "nomtp").mkdir()
    (tmp_path / "nomtp" / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="num_nextn_predict_layers = 0"):
        validate_model(str(tmp_path / "nomtp"))


def test_draft_score_temperature_comes_from_the_checkpoint():
    assert draft_score_temperature({}) == 1.0
    embedded = draft_score_temperature(validate_model(str(EMBEDDED)))
    assert 0 < embedded < 1, "the embedded model ships a fitted calibration (scripts/calibrate_tiny_v4.py)"
    assert draft_score_temperature({"tree_v4": {"draft_score_temperature": 2}}) == 2.0
    for bad in (0, -1, "0.5", True, None):
        with pytest.raises(ValueError, match="tree_v4.draft_score_temperature"):
            draft_score_temperature({"tree_v4": {"draft_score_temperature": bad}})
    with pytest.raises(ValueError, match="'tree_v4'"):
        draft_score_temperature({"tree_v4": 0.5})


@pytest.mark.server
def test_launcher_stops_with_the_flag_named():
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(EMBEDDED),
                           "--speculative-algorithm", "TREE_V4", "--speculative-eagle-topk", "3",
                           "--speculative-num-steps", "9", "--port", str(srv.free_port())],
                          env=srv.clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--speculative-num-steps" in proc.stderr


@pytest.mark.server
def test_a_plain_kv_pool_is_refused_naming_the_flag():
    """The state needs SGLang's hybrid sliding-window pool (``serving.sglang_pool``); asking SGLang for a plain pool
    stops the server at startup with a message naming the flag, instead of mis-sizing the pool."""
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(EMBEDDED),
                           "--disable-hybrid-swa-memory", "--port", str(srv.free_port())],
                          env=srv.clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "drop --disable-hybrid-swa-memory" in proc.stdout + proc.stderr


@pytest.mark.server
@pytest.mark.parametrize("algorithm", [[], ["--speculative-algorithm", "TREE_V4"]], ids=["plain", "tree"])
def test_a_page_that_splits_a_compression_block_is_refused(algorithm):
    """Entries are kept a row per block of each ratio, which needs pages of whole blocks (the embedded model: ratios
    4 and 16, pages of 16 by default); ``--page-size 8`` stops the launcher naming the flag."""
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(EMBEDDED),
                           "--page-size", "8", *algorithm, "--port", str(srv.free_port())],
                          env=srv.clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--page-size 8" in proc.stdout + proc.stderr and "multiple of 16" in proc.stdout + proc.stderr


@pytest.mark.server
def test_another_speculative_algorithm_is_refused_on_the_cpu():
    """On a CPU our DeepSeek-V4 serves every request; only the TREE_V4 worker commits what its verify forward leaves
    in tree scratch, so ``--speculative-algorithm NGRAM`` stops the launcher naming the flag."""
    proc = subprocess.run([sys.executable, "-m", "sglang.launch_server", "--model-path", str(EMBEDDED),
                           "--speculative-algorithm", "NGRAM", "--port", str(srv.free_port())],
                          env=srv.clean_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "--speculative-algorithm NGRAM" in proc.stdout + proc.stderr


def test_default_page_holds_whole_blocks():
    from sglang_tree_v4.dsv4.config import DSV4Config, read_checkpoint_config
    from sglang_tree_v4.serving.sglang_pool import check_page_size
    cfg = DSV4Config.from_dict(read_checkpoint_config(str(EMBEDDED)))
    assert check_page_size(cfg, None) == 16 and check_page_size(cfg, 64) == 64
    with pytest.raises(ValueError, match="--page-size 4"):
        check_page_size(cfg, 4)

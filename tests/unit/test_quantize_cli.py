"""profiling/quantize_rtn.py: the writer's command line, plain and AWQ-calibrated on text the model samples itself."""

from __future__ import annotations

import json
import os

from graphdecode.bench.common import script_module
from tests.helpers import REPO


def test_the_cli_writes_plain_and_calibrated_checkpoints_that_load(text_model, tmp_path):
    cli = script_module(os.path.join(REPO, "profiling", "quantize_rtn.py"))
    src = text_model  # a llama with a tokenizer: the calibration text is sampled from prompts
    plain = cli.main([src, str(tmp_path / "rtn"), "--bits", "4", "--group", "32"])
    calibrated = cli.main([src, str(tmp_path / "awq"), "--bits", "4", "--group", "32", "--awq",
                           "--calibration-sequences", "2", "--calibration-length", "24"])
    assert plain["write_s"] > 0 and "calibration_tokens" not in plain
    assert calibrated["calibration_tokens"] > 2 * 24 - 1  # each sequence: its prompt and up to 24 sampled tokens
    for name in ("rtn", "awq"):
        with open(tmp_path / name / "config.json") as f:
            quant = json.load(f)["quantization_config"]
        assert quant["format"] == "pack-quantized"
        assert quant["config_groups"]["group_0"]["weights"]["group_size"] == 32
    from graphdecode import LLM, SamplingParams

    with LLM(str(tmp_path / "awq"), dtype="float32", cpu_threads=1) as llm:
        out = llm.generate({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=4, temperature=0))
    assert len(out[0].outputs[0].token_ids) == 4

"""The attention-logit-growth proxy of examples/attention_logit_growth.py in fp32: the same slow
divergence as its bf16 target (every value finite, the loss breaks away), at fp32's CPU speed."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "examples"))

from attention_logit_growth import build  # noqa: E402


def target():
    return build("fp32")

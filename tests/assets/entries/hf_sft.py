"""The ENTRY a transformers user writes to replay a NanprobeCallback capsule: the Trainer their script
builds (model, TrainingArguments, dataset), handed to nanprobe's replay_target; the capsule fills it."""

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integrations"))

from test_integrations import SFTData, _gpt2, _hf_trainer  # noqa: E402

from nanprobe.integrations.transformers import replay_target  # noqa: E402


def target():
    return replay_target(_hf_trainer(_gpt2(), SFTData(), [], Path(tempfile.mkdtemp(prefix="hf-sft-"))))

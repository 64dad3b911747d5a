"""The drafter's training code is library code (dspark/training/) that needs torch only in the
steps that train: its command line, its data and model modules and everything serving imports
load without torch, and the training prompts stay apart from the held-out ones."""
from __future__ import annotations

import subprocess
import sys

from dspark.paths import project_root


def test_training_and_serving_modules_import_without_torch():
    code = ("import sys\n"
            "import dspark.cli.train, dspark.training.data, dspark.training.drafter, dspark.training.prompts\n"
            "import dspark.triton.models, dspark.cli.main\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_the_training_tool_is_a_wrapper_of_dspark_train():
    run = subprocess.run([sys.executable, str(project_root() / "tools" / "train_dspark.py"), "--help"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and all(step in run.stdout for step in ("gather", "vocab", "train", "export")), run.stderr


def test_held_out_prompts_are_not_training_prompts():
    from dspark.training.prompts import heldout_prompts, training_prompts

    train = {p["text"] for p in training_prompts(2000)}
    held = [p["text"] for p in heldout_prompts(6)]
    assert held and not train.intersection(held)
    assert {p["kind"] for p in heldout_prompts(6)} == {"chat", "summarize", "code", "continue"}

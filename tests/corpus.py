"""The training corpus for the default-model tests: the real one (found by the training tool's own
rule, skipped with that reason when absent) and a small synthetic play for the training-script tests.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TRAINER = ROOT / "tools" / "train_default_model.py"

SPEAKERS = ["ROMEO", "JULIET", "First Citizen", "MENENIUS", "KING HENRY", "NURSE"]
WORDS = ("thou thee thy lord good sweet night day love death king crown sword heart fair speak "
         "come go hence now yet what shall will not the and of to my is be in with").split()


def load_trainer():
    """tools/train_default_model.py as a module (it is a script, not part of the package)."""
    if "train_default_model" in sys.modules:
        return sys.modules["train_default_model"]
    spec = importlib.util.spec_from_file_location("train_default_model", TRAINER)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def real_corpus() -> Path:
    """tiny-shakespeare where the training tool looks for it, or skip the test saying where that is."""
    trainer = load_trainer()
    path = trainer.default_corpus_path()
    if not path.is_file():
        pytest.skip(f"training corpus not found at {path}: set {trainer.CORPUS_ENV} to tinyshakespeare.txt "
                    "(or put it in ../shared/data/ beside the repository)")
    return path


def synthetic_play(chars: int, seed: int = 0) -> str:
    """Speeches in tiny-shakespeare's layout ("NAME:" line, verse lines, blank line) from a small
    seeded vocabulary: enough structure for 20 training steps to lower the validation loss."""
    rng = random.Random(seed)
    speeches, size = [], 0
    while size < chars:
        lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 9))).capitalize() + rng.choice(",.;!?")
                 for _ in range(rng.randint(1, 4))]
        speech = f"{rng.choice(SPEAKERS)}:\n" + "\n".join(lines) + "\n\n"
        speeches.append(speech)
        size += len(speech)
    return "".join(speeches)[:chars]

"""The prompt tokenizer knows the engine's presets from their one source, without torch: the
router (which imports it) starts without loading the model code."""

from __future__ import annotations

import subprocess
import sys


def test_preset_names_come_from_the_engine_without_torch() -> None:
    code = (
        "import sys\n"
        "from kvoffload.serving.prompts import PRESET_NAMES\n"
        "import kvoffload.routing.router\n"
        "from kvoffload.engine.model_config import PRESETS\n"
        "assert PRESET_NAMES == frozenset(PRESETS), PRESET_NAMES\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout

"""``make demo`` says what its LM is and where to read how to serve a real one."""

from pathlib import Path

from warmup_tools.ops.demo import REAL_MODEL_SECTION, lm_note
from warmup_tools.server.config import ServeConfig

SERVING = Path(__file__).resolve().parents[3] / "docs" / "serving.md"


def test_the_note_says_the_lm_is_random_and_names_a_readme_section_that_exists(tmp_path):
    note = lm_note(ServeConfig(assets_dir=tmp_path))
    assert "random weights" in note and "noise" in note and str(tmp_path / "lm") in note
    assert f'"{REAL_MODEL_SECTION}"' in note
    assert f"\n## {REAL_MODEL_SECTION}\n" in SERVING.read_text(encoding="utf-8")

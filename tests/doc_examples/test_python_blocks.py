"""Every ```python block of README.md and docs/*.md runs as written (doc_blocks.py says which
blocks), each in a fresh directory with the interpreter running pytest and PYTHONPATH set to the
built package, as the README tells a user to run it. A block must be a whole script: its
imports included."""
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
import doc_blocks  # noqa: E402

SOURCE = Path(os.environ.get("ATTEND_SOURCE_DIR", Path(__file__).resolve().parents[2]))
BLOCKS = doc_blocks.python_blocks(SOURCE)


def test_the_documents_have_python_blocks():
    assert BLOCKS, f"no ```python block found under {SOURCE}"


@pytest.mark.parametrize("block", BLOCKS, ids=[b.where for b in BLOCKS])
def test_block_runs(block, tmp_path):
    script = tmp_path / f"{block.name}.py"
    script.write_text(block.code, encoding="utf-8")
    run = subprocess.run([sys.executable, str(script)], cwd=tmp_path, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=300)
    assert run.returncode == 0, f"{block.where} failed:\n{run.stdout}"

"""The CUDA image pins the torch release whose CUDA paths Brigade was written against."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_cuda_image_pins_torch_through_make_venv() -> None:
    text = (ROOT / "k8s" / "Dockerfile.cuda").read_text()
    assert re.search(r"^RUN make venv HAS_CUDA=yes TORCH_CUDA=torch==2\.13\.0$", text, flags=re.M)
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH_CUDA \?= torch==2\.13\.0$", makefile, flags=re.M)
    assert "$(PIP) install $(TORCH_CUDA)" in makefile

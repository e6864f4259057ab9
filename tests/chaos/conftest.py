"""The chaos suite shares tests/'s helpers (serve_process, helpers): put that folder on the path."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

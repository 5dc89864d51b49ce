import sys
from pathlib import Path

import pytest

TESTS_DIR = Path(__file__).parent
sys.path.insert(0, str(TESTS_DIR))

FIXTURES = TESTS_DIR / "fixtures" / "megatron"


@pytest.fixture
def fixtures_dir() -> Path:
    return FIXTURES

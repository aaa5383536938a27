import os
import tempfile
from pathlib import Path

import platformdirs
import pytest
import torch


def pytest_configure(config):
    """The app's cache folder for this test session: a fresh one, so that kernel choices and
    step-cost curves measured by the tests (on a machine busy with them) never become the user's
    (`cpu-kernels.json`, `step-costs`); the compiled kernel library and converted model files, which
    do not depend on timing, are the user's folders, linked in."""
    real = Path(platformdirs.user_cache_dir("medusa-chat"))
    session = Path(tempfile.mkdtemp(prefix="medusa-chat-tests-")) / "cache"
    (session / "medusa-chat").mkdir(parents=True)
    for shared in ("kernels", "models"):
        (real / shared).mkdir(parents=True, exist_ok=True)
        (session / "medusa-chat" / shared).symlink_to(real / shared, target_is_directory=True)
    os.environ["XDG_CACHE_HOME"] = str(session)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """Empty data and config folders for the app (its chats folder made), in tmp_path."""
    from app import store

    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "data"))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    store.chats_dir().mkdir(parents=True)
    return tmp_path


@pytest.fixture(autouse=True)
def _fresh_kernel_choices():
    """Each test starts from the step ops' default choices (attention in vectors, bf16 keys and
    values): a model loaded by one test sets them for the models loaded after it."""
    from core.backends import stepops

    saved = dict(stepops._chosen)
    yield
    stepops._chosen.update(saved)

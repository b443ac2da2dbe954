import pathlib
import sys

import pytest

sys.path.insert(0, str(pathlib.Path(__file__).parent))


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory):
    from checkpoints import make_checkpoint
    return make_checkpoint(tmp_path_factory.mktemp("llama"), "llama")

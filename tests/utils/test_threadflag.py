"""ThreadFlag: set for a block on one thread only, put back as it was (nested blocks, errors)."""

import threading

import pytest

from trainguard.utils.threadflag import ThreadFlag


def test_a_flag_is_set_for_its_block_and_put_back_even_on_error():
    f = ThreadFlag()
    assert f.active is False
    with f.set():
        assert f.active is True
        with f.set(False):
            assert f.active is False
        assert f.active is True
    assert f.active is False
    with pytest.raises(RuntimeError), f.set():
        raise RuntimeError("inside")
    assert f.active is False


def test_a_flag_set_on_one_thread_is_off_on_another():
    f = ThreadFlag()
    seen = []
    with f.set():
        t = threading.Thread(target=lambda: seen.append(f.active))
        t.start()
        t.join()
        assert f.active is True
    assert seen == [False]

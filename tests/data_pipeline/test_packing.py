import numpy as np
import pytest

from data_pipeline.packing import WindowPacker


def docs(seed=0, n=40):
    rng = np.random.default_rng(seed)
    return [list(rng.integers(5, 100, rng.integers(1, 50))) for _ in range(n)]


def test_every_token_in_exactly_one_window():
    packer = WindowPacker(17)
    windows = [w for d in docs() for w in packer.add([*d, 2])]
    stream = [t for d in docs() for t in [*d, 2]]
    assert all(len(w) == 17 for w in windows)
    flat = np.concatenate(windows).tolist()
    assert flat == stream[: len(flat)]
    assert packer.state_dict()["carry"].tolist() == stream[len(flat) :]
    assert len(stream) - len(flat) < 17


def test_state_taken_between_windows_resumes_exactly():
    data = docs(1)
    reference = WindowPacker(9)
    full = [w.tolist() for d in data for w in reference.add(d)]
    packer, got, state, stop = WindowPacker(9), [], None, None
    for i, d in enumerate(data):
        for w in packer.add(d):
            got.append(w.tolist())
            if len(got) == 7:  # snapshot in the middle of a document's windows
                state, stop = packer.state_dict(), i
                break
        if state:
            break
    resumed = WindowPacker(9)
    resumed.load_state_dict(state)
    got += [w.tolist() for d in data[stop + 1 :] for w in resumed.add(d)]
    assert got == full


def test_window_too_small():
    with pytest.raises(ValueError, match="at least 2"):
        WindowPacker(1)

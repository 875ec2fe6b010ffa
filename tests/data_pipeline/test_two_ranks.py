"""Two ranks (gloo, 2 DataLoader workers each) read FineWeb-Edu-schema parquet through the
streaming pipeline; a run stopped after 5 micro-batches (the process exits) and resumed in
a new process from the saved data state sees exactly the batches of an uninterrupted run."""

from pathlib import Path

import torch
from corpora import write_fineweb

from tests.jobs import ROOT, job_env, run_job, torchrun_command

SCRIPT = Path(__file__).with_name("two_ranks.py")


def torchrun(tmp_path, phase, timeout=300):
    command = torchrun_command(
        2, str(SCRIPT), str(tmp_path), phase,
        f"data.sources=[{{uri: 'hf:{tmp_path / 'fineweb-edu'}:sample-10BT', id_column: id}}]",
        "data.num_workers=2", "data.tokenizer.vocab_size=512", "data.validation_fraction=0.05",
        "model.seq_length=32", "train.micro_batch_size=4", f"run.cache_dir={tmp_path / 'cache'}",
    )  # fmt: skip
    # the script's own folder is on its path (corpora.py); the checkout's packages via job_env
    done = run_job(command, timeout, cwd=ROOT, env=job_env())
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]


def test_two_ranks_stop_and_resume_exactly(tmp_path):
    write_fineweb(tmp_path / "fineweb-edu", files=4, rows_per_file=12, row_group_size=4, chars=600)
    torchrun(tmp_path, "first")
    torchrun(tmp_path, "resume")
    windows = []
    for rank in range(2):
        full = torch.load(tmp_path / f"full{rank}.pt")
        got = torch.load(tmp_path / f"first{rank}.pt") + torch.load(tmp_path / f"resumed{rank}.pt")
        assert len(got) == len(full) == 12
        assert all(torch.equal(a, b) for a, b in zip(got, full, strict=True))
        windows.append({tuple(w.tolist()) for batch in full for w in batch})
    assert windows[0].isdisjoint(windows[1])  # the ranks read different documents

"""``spawn_ranks``: a finished rank leaves with ``os._exit``, but first runs the multiprocessing finalizers a
normal child process runs, so a lock it made (Inductor's tqdm progress bar makes one in every compiling
rank) is released, and the parent does not end with "resource_tracker: There appear to be N leaked
semaphore objects" (seen at the end of every ``python -m stepops demo --tp 2``)."""

import subprocess
import sys
import textwrap


def test_a_lock_made_in_a_rank_is_not_reported_leaked(tmp_path):
    script = tmp_path / "spawn_probe.py"
    script.write_text(textwrap.dedent("""
        import multiprocessing

        from stepops.models.tensor_parallel import spawn_ranks

        _KEPT = []

        def make_a_lock(rank, tp_size):
            _KEPT.append(multiprocessing.get_context("spawn").RLock())  # as tqdm does, kept until exit

        if __name__ == "__main__":
            spawn_ranks(make_a_lock, 2)
            print("ranks done")
    """))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "ranks done" in result.stdout
    assert "leaked semaphore" not in result.stderr, result.stderr

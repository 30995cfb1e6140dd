"""One rank of tests/test_dist.py's failure tests: scenario NAME makes one rank fail at one point
of a collective section, and every rank must then end by itself, within seconds, with an error
that names the original one.

    python tests/dist_fail_child.py NAME FOLDER

test_dist.py starts 2 of them as torchrun starts its workers (RANK, WORLD_SIZE, MASTER_ADDR /
MASTER_PORT of a store the launcher holds) and gives every scenario its go at once (`ready`).
The frame is train.py's: a process-group timeout of a day (a rank left waiting would hang), the
run inside try / except dist.share_failure / finally dist.teardown, and a SIGTERM that does not
end the process (train.py's StopSignal turns it into a flag; torchrun's agent sends one to the
other ranks as soon as one exits).
"""

import os
import signal
import sys
import types

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dist

PLANTED = "planted failure: "  # every planted error's message starts with it


def ready():
    """Tell the test this rank is ready, then wait for its go: it starts every scenario's
    processes at once, and times each one's end from the go it gives once all have loaded."""
    store = torch.distributed.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    store.set(f"ready-{dist.rank()}", "")
    store.wait(["go"])


def answer_fn(failing_rank):
    """A stand-in for GEPA's greedy answers on this rank: squares; its second call fails on
    `failing_rank` (None: never)."""
    calls = []

    def answer(items):
        calls.append(items)
        if dist.rank() == failing_rank and len(calls) == 2:
            raise ValueError(PLANTED + f"rank {failing_rank}'s share of an answer call")
        return [x * x for x in items]
    return answer


def gepa_round(failing_rank=None, fail_between_calls=False):
    """end_epoch's shape: rank 0 makes two shared answer calls inside dist.leading() (and may
    fail between them), the other ranks serve."""
    answer = answer_fn(failing_rank)
    ready()
    if dist.is_main():
        with dist.leading():
            assert dist.shared_map(answer, range(5)) == [0, 1, 4, 9, 16]
            if fail_between_calls:
                raise ValueError(PLANTED + "rank 0 between two answer calls")
            dist.shared_map(answer, range(5))
    else:
        dist.serve(answer)


class UnwritablePolicy(torch.nn.Linear):
    """A policy whose weights cannot be written on rank 0 (as with a full disk)."""
    config = types.SimpleNamespace()

    def save_pretrained(self, folder, **_):
        raise OSError(PLANTED + "rank 0 writing a checkpoint's weights")


class UnwritableState:
    """A rank's optimizer state that cannot be written."""

    def __reduce__(self):
        raise OSError(PLANTED + f"rank {dist.rank()} writing its own checkpoint file")


def checkpoint(failing_rank, folder):
    """runs.save_checkpoint under torchrun: the weights gathered to rank 0, then rank 0's files
    fail to be written (failing_rank 0) or rank 1's own file does (failing_rank 1)."""
    # deferred, heavy: runs.py's imports (plots, TensorBoard) and the state-dict code that
    # dist.full_state_dict imports on first use; the other scenarios do without them
    import runs
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    ready()
    policy = UnwritablePolicy(4, 4) if failing_rank == 0 else torch.nn.Linear(4, 4)
    own = {"optimizer": UnwritableState() if failing_rank == dist.rank() == 1 else {}}
    runs.save_checkpoint(folder, 1, policy, None, {"config": {}}, own)


def between_collectives(failing_rank):
    """A rank fails between two collectives of a step while the other waits in the second."""
    ready()
    dist.all_sum(1)
    if dist.rank() == failing_rank:
        raise ValueError(PLANTED + f"rank {failing_rank} between two collectives")
    dist.barrier()


SCENARIOS = {
    "share0": lambda folder: gepa_round(failing_rank=0),
    "share1": lambda folder: gepa_round(failing_rank=1),
    "lead0": lambda folder: gepa_round(fail_between_calls=True),
    "checkpoint0": lambda folder: checkpoint(0, folder),
    "checkpoint1": lambda folder: checkpoint(1, folder),
    "between0": lambda folder: between_collectives(0),
    "between1": lambda folder: between_collectives(1),
}


def main(name, folder):
    signal.signal(signal.SIGTERM, lambda signum, frame: None)  # as train.py's StopSignal
    rank, _, _ = dist.setup("cpu", timeout_minutes=24 * 60)  # train.py's timeout
    try:
        SCENARIOS[name](folder)
    except BaseException as e:
        dist.share_failure(e)
        raise
    finally:
        dist.teardown()
    print(f"rank {rank}: scenario {name} ended without an error", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])

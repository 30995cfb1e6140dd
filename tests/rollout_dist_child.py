"""One rank of tests/test_rollout.py's torchrun test: an in-process vLLM-CPU engine per rank
(external_launcher), the same seeded call twice and the same prompts as the other rank.

    python -m torch.distributed.run --standalone --nproc_per_node=2 tests/rollout_dist_child.py MODEL OUT
"""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import dist
from rollout import VLLMRollout


def main(model, out):
    rank, world, _ = dist.setup("cpu")
    engine = VLLMRollout(model, dtype="bfloat16", max_model_len=256, seed=0, external_launcher=True, rank=rank,
                         progress_bars=False)
    prompts = ["The capital of France is", "Once upon a time"]
    calls = [engine.generate(prompts, n=3, temperature=1.0, max_tokens=12, seed=7) for _ in range(2)]
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump([[[s.response_ids for s in g] for g in groups] for groups in calls], f)
    engine.close()
    dist.teardown()


if __name__ == "__main__":
    main(*sys.argv[1:])

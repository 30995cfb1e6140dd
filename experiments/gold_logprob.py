"""How likely does a policy find the gold answers? Teacher-forced log-probabilities of each
problem's gold response under the plain prompt: the confirmatory study's primary outcome
(docs/PREREGISTRATION.md), computed by compare.py at the end of every run of a task that asks.

    python experiments/gold_logprob.py --model=PATH --data=fictional-heldout --fact=13

For every problem: its gold response (prompts.gold_text: the solution and the boxed answer, no
EOS) after the plain prompt (no template, the default prompt format), one forward with
train.py's row_logprobs at temperature 1 (the policy's own distribution, float32), and
- logp_mean: the mean log-prob per response token (the outcome: no floor at 0 correct, unlike accuracy),
- logp_sum and tokens,
- fact_logp: the summed log-prob of the tokens that spell the first occurrence of --fact in the
  response (on the fictional task, the "13" that only a template teaches), None without one.
The outcome of a policy is the mean of logp_mean over the problems.
"""

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import load_jsonl  # noqa: E402
from forward import row_logprobs  # noqa: E402
from model import pad_token_id  # noqa: E402
from prompts import problem_messages  # noqa: E402
from prompts import encode_prompt  # noqa: E402
from prompts import gold_text  # noqa: E402


def fact_positions(tokenizer, text, fact):
    """Indices of the response tokens that overlap the first occurrence of `fact` in `text`
    ([] when it has none); the tokens are those of tokenizer(text) without special tokens."""
    start = text.find(fact) if fact else -1
    if start < 0:
        return []
    end = start + len(fact)
    offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return [i for i, (a, b) in enumerate(offsets) if a < end and b > start]


@torch.no_grad()
def gold_logprobs(model, tokenizer, problems, fact="", batch=16):
    """[{"id", "tokens", "logp_sum", "logp_mean", "fact_logp"}] for each problem (see the module doc)."""
    rows = []
    for s in range(0, len(problems), batch):
        chunk = problems[s:s + batch]
        missing = [p.id for p in chunk if not p.solution]
        if missing:
            raise SystemExit(f"gold log-probs: problem {missing[0]} has no solution")
        texts = [gold_text(p) for p in chunk]
        prompts = [encode_prompt(tokenizer, problem_messages(p)) for p in chunk]
        responses = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
        logps = row_logprobs(model, prompts, responses, pad_token_id(tokenizer), 1.0)
        for p, text, logp in zip(chunk, texts, logps):
            logp = logp.double()
            at = fact_positions(tokenizer, text, fact)
            rows.append({"id": p.id, "tokens": len(logp), "logp_sum": logp.sum().item(), "logp_mean": logp.mean().item(),
                         "fact_logp": logp[at].sum().item() if at else None})
    return rows


def summary(rows):
    """The outcome and its parts over the problems: {"logp_mean", "logp_sum", "fact_logp", "problems"}."""
    facts = [r["fact_logp"] for r in rows if r["fact_logp"] is not None]
    return {"logp_mean": statistics.mean(r["logp_mean"] for r in rows),
            "logp_sum": statistics.mean(r["logp_sum"] for r in rows),
            "fact_logp": statistics.mean(facts) if facts else None, "problems": len(rows)}


def score_checkpoint(path, problems, fact=""):
    """gold_logprobs of a model folder, loaded in float32 on the CPU."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return gold_logprobs(model, tokenizer, problems, fact)


def main(argv=None):
    from model import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a checkpoint folder, hub name or shipped alias")
    ap.add_argument("--data", default="fictional-heldout", help="a data name or path (data/__init__.py)")
    ap.add_argument("--fact", default="", help="a string of the gold responses whose tokens' log-prob is also given")
    args = ap.parse_args(argv)
    rows = score_checkpoint(resolve_model(args.model), load_jsonl(args.data)[0], args.fact)
    for r in rows:
        print(json.dumps(r))
    print(json.dumps(summary(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

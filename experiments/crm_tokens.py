"""Which tokens does the Context Ratio Mask drop? Per-token c_t of one response, printed.

    python experiments/crm_tokens.py --question="How many snigs are in 2 plonks?" \
        --response="2 plonks = 2 × 13 = 26 snigs. The answer is \\boxed{26}." \
        --template="$(tail -n 1 data/fictional/facts.txt)" [--model=PATH] [--crm_low=0.01 --crm_high=10]

For every response token: its log-prob under the plain prompt x and under the templated prompt
x~ = T(x, z), log c_t = log pi(y_t | x) - log pi(y_t | x~), and whether the CRM drops it: the
log-probs come from train.py's row_logprobs at its temperature, the mask from distill.py, so it
is what training computes. Run it on the starting model to see what the first
distillation step would mask. On the fictional task it shows the mechanism's failure mode: the
token that carries the template-only fact (the 3 of "13") is the one the template makes
thousands of times likelier, so the mask drops exactly what distillation should move
(docs/EVIDENCE.md).
"""

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data import Problem  # noqa: E402
from distill import crm_weights  # noqa: E402
from model import pad_token_id  # noqa: E402
from prompts import problem_messages  # noqa: E402
from prompts import encode_prompt  # noqa: E402
from train import Config, row_logprobs  # noqa: E402


@torch.no_grad()
def token_ratios(model, tokenizer, question, response, template, low=0.01, high=10.0, prompt_format="default",
                 temperature=Config.temperature):
    """[(token text, log p plain, log p templated, log c_t, masked)] for each response token, with
    the log-probs train.py feeds the CRM (row_logprobs at its sampling temperature)."""
    problem = Problem(id="crm", problem=question, answer="0", solution="", source="")
    prompts = [encode_prompt(tokenizer, problem_messages(problem, t, fmt=prompt_format)) for t in ("", template)]
    response_ids = tokenizer(response, add_special_tokens=False)["input_ids"]
    plain, tilde = row_logprobs(model, prompts, [response_ids] * 2, pad_token_id(tokenizer), temperature)
    weights, log_c = crm_weights(plain, tilde, low, high)
    return [(tokenizer.decode([t]), p.item(), q.item(), c.item(), w.item() == 0.0)
            for t, p, q, c, w in zip(response_ids, plain, tilde, log_c, weights)]


def main(argv=None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from model import resolve_model

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m", help="a checkpoint folder, hub name or shipped alias")
    ap.add_argument("--question", required=True)
    ap.add_argument("--response", required=True)
    ap.add_argument("--template", required=True)
    ap.add_argument("--crm_low", type=float, default=0.01)
    ap.add_argument("--crm_high", type=float, default=10.0)
    ap.add_argument("--prompt_format", default="default")
    ap.add_argument("--temperature", type=float, default=Config.temperature, help="as train.py's: the CRM's log-probs use it")
    args = ap.parse_args(argv)
    path = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = token_ratios(model, tokenizer, args.question, args.response, args.template, args.crm_low,
                        args.crm_high, args.prompt_format, args.temperature)
    print(f"band: log c in [{math.log(args.crm_low):.2f}, {math.log(args.crm_high):.2f}]")
    print(f"{'token':14} {'log p(x)':>9} {'log p(x~)':>10} {'log c':>7}")
    for text, p, q, c, masked in rows:
        print(f"{text!r:14} {p:9.2f} {q:10.2f} {c:7.2f}" + ("  MASKED" if masked else ""))
    print(f"{sum(r[4] for r in rows)} of {len(rows)} tokens masked")
    return 0


if __name__ == "__main__":
    sys.exit(main())

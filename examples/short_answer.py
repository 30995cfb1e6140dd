"""A reward outside math, for --reward=examples/short_answer.py:exact_match: SQuAD-style exact
match of a short answer (lower case, punctuation and the articles a / an / the dropped, spaces
collapsed). The answer is the response's last \\boxed{} (the prompt asks for one), else its last
non-empty line. With the shipped questions:

    python train.py --train_data=examples/capitals.jsonl --dev_data='' --algo=grpo \\
        --reward=examples/short_answer.py:exact_match --max_steps=4

    exact_match("It is \\\\boxed{buenos aires}.", Problem("ar", "...", "Buenos Aires"))  -> 1.0
    exact_match("Rosario, I think", Problem("ar", "...", "Buenos Aires"))            -> 0.0
"""

import re
import string

from verify import last_boxed  # train.py and eval.py run from the repository's root, which holds verify.py

ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalise(text):
    text = "".join(c for c in text.lower() if c not in string.punctuation)
    return " ".join(ARTICLES.sub(" ", text).split())


def final_answer(response):
    """The last \\boxed{} content, else the last non-empty line ('' for an empty response)."""
    boxed, _ = last_boxed(response)
    if boxed is not None:
        return boxed
    lines = [line for line in response.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def exact_match(response, problem):
    """1.0 iff the normalised final answer equals the normalised gold answer (problem.answer)."""
    return float(normalise(final_answer(response)) == normalise(problem.answer))

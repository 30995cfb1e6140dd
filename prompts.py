"""How a problem becomes chat messages, and how a P²O template is applied to it.

    build_messages("What is 7 + 4 × 3?", template="Multiply first.", fewshot=False)
    -> [{"role": "user", "content":
         "Multiply first.\\n\\nWhat is 7 + 4 × 3?\\nPut the final answer in \\\\boxed{}."}]

The answer-format instruction belongs to the original user text, never to the template, so an
evolved template cannot break answer extraction (docs/METHOD.md §2). With `fewshot=True` three worked
one-step examples come first as earlier chat turns: the 135M default model almost never writes
\\boxed{} otherwise (measured: docs/TASKS.md, "Default model and data"). They are used for the shipped tasks only (built-in, fictional units, subtraction; `problem_messages`).

Two prompt formats (`fmt`, train.py's --prompt_format):
    default   "<problem>\nPut the final answer in \\boxed{}."      (+ the few-shot turns for built-in rows)
    official  "Let's think step by step and output the final answer within \\boxed{}.\nQuestion: <problem>"
              (the P²O reference code's data preparation; no few-shot turns)
"""

FORMAT_INSTRUCTION = "Put the final answer in \\boxed{}."
OFFICIAL_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."
FORMATS = ("default", "official")

FEWSHOT_SOURCES = ("builtin", "fictional", "subtract")  # the shipped tasks (data/): their rows get FEWSHOT
FEWSHOT = [  # (question, worked answer); no built-in problem repeats these (data/builtin.py)
    ("What is 2 + 3?", "2 + 3 = 5. The answer is \\boxed{5}."),
    ("What is 4 × 2?", "4 × 2 = 8. The answer is \\boxed{8}."),
    ("What is 6 + 1?", "6 + 1 = 7. The answer is \\boxed{7}."),
]


def user_text(problem, fmt="default"):
    """The original user text x: the problem and the answer-format instruction, in format `fmt`."""
    if fmt == "official":
        return OFFICIAL_INSTRUCTION + "\nQuestion: " + problem.strip()
    if fmt != "default":
        raise ValueError(f"prompt format must be one of {FORMATS}, got {fmt!r}")
    return problem.strip() + "\n" + FORMAT_INSTRUCTION


def apply_template(text, template):
    """T(x, z): the template, a blank line, then the original user text. '' means no template."""
    return text if not template.strip() else template.strip() + "\n\n" + text


def build_messages(problem, template="", fewshot=False, fmt="default"):
    """Chat messages for one problem, optionally templated and with the few-shot turns first."""
    messages = []
    if fewshot:
        for question, answer in FEWSHOT:
            messages.append({"role": "user", "content": user_text(question)})
            messages.append({"role": "assistant", "content": answer})
    messages.append({"role": "user", "content": apply_template(user_text(problem, fmt), template)})
    return messages


def problem_messages(p, template="", fmt="default"):
    """Messages for a data row (data.Problem): the few-shot turns are part of the built-in
    task's default prompt format only, so rows from other sources (or the official format) get none."""
    fewshot = fmt == "default" and bool(p.source) and p.source.startswith(FEWSHOT_SOURCES)
    return build_messages(p.problem, template, fewshot, fmt)


def gold_text(p):
    """A problem's gold response (train.py's --algo=sft): its `solution`, ended by the boxed answer the prompt asks for
    (appended when it has none)."""
    return p.solution if "\\boxed" in p.solution else f"{p.solution} The answer is \\boxed{{{p.answer}}}."


def encode_prompt(tokenizer, prompt, chat_template_kwargs=None):
    """Chat messages -> chat-template ids with the generation prompt; a string -> its ids.
    Messages ending with an assistant turn are a prefill: the answer continues that text.
    chat_template_kwargs go to the template, e.g. {"enable_thinking": False} for Qwen3."""
    if isinstance(prompt, str):
        return tokenizer(prompt).input_ids
    kwargs = chat_template_kwargs or {}
    if prompt[-1]["role"] == "assistant":
        text = tokenizer.apply_chat_template(prompt, tokenize=False, continue_final_message=True, **kwargs)
    else:
        text = tokenizer.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer(text, add_special_tokens=False).input_ids

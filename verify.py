"""Binary reward: 1 iff the response's final \\boxed{...} is mathematically equal to the answer.

    reward("so x = 1/2, i.e. \\boxed{\\dfrac{1}{2}}", "0.5")   -> 1.0
    check("\\boxed{3} or rather \\boxed{4}", "3")
        -> Verdict(reward=0.0, extracted='4', reason='not_equivalent')

Model output is untrusted text. Nothing here passes it to eval/exec/sympify/parse_expr:
the box is found by a linear-time brace scanner; equivalence is decided by math-verify's LaTeX
parser (an ANTLR grammar that builds sympy objects) with its Python-expression fallback
(which calls parse_expr) switched off. Every check is bounded:

- in size: the boxed answer is at most MAX_ANSWER_CHARS characters and MAX_NESTING deep;
- in time: the sympy work runs in a child process that is killed after `timeout` seconds, so the
  bound holds in any thread of any process (signal-based timeouts only work in a main thread);
- in memory: the child caps its address space (WORKER_MEMORY_BYTES).

Both answers are cleaned alike before either path (outer whitespace and a trailing full stop
dropped). Cheap cases never reach the child: the same text up to `\\dfrac`/`\\tfrac` and how an
integer is written (`004`, `+4`, `-0`) (reason 'exact_match'), and two integers of different value
('not_equivalent'). math-verify gives these the same verdicts, except that it scores identical
text it cannot parse 0.

Two rules, chosen by name (`--reward`; `load_reward` also takes any Python callable):

- "ours" (`reward`/`check`): the final box decides, however many boxes there are;
- "official" (`official_reward`/`official_check`): the effect of the reward in the reference P2O
  code (its DeepMath `reward_func`): 0 unless the response contains the text `\\boxed` exactly
  once; then `check`, and where `check` says 0 a lenient numeric comparison (relative tolerance
  1e-4, and the gold answer also read as a percentage, /100 or *100).

    "First guess \\boxed{3}; no, it is \\boxed{4}." vs "4":  ours 1, official 0 (two boxes)
    "\\boxed{0.5}" vs "50":  ours 0, official 1 (the percentage reading)
    "\\boxed{3.14159}" vs "3.1416":  ours 0, official 1 (relative 1e-4)
"""

import contextlib
import json
import math
import numbers
import os
import re
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import numpy as np

MAX_ANSWER_CHARS = 1000  # a longer boxed answer scores 0 ('answer_too_long')
MAX_NESTING = 64  # deeper bracket nesting scores 0 ('too_deeply_nested')
DEFAULT_TIMEOUT = 2.0  # seconds for one equivalence check, child start-up excluded
STARTUP_TIMEOUT = 120.0  # seconds for the child to import sympy and math-verify
WORKER_MEMORY_BYTES = 4 << 30  # RLIMIT_AS of the child process


@dataclass(frozen=True)
class Verdict:
    reward: float  # 1.0 or 0.0
    extracted: str | None  # content of the final box, None when there is none
    reason: str  # exact_match | equivalent | not_equivalent | no_box | unclosed_box | empty_box |
    #              answer_too_long | too_deeply_nested | unparsable | timeout | worker_died |
    #              (official rule only) not_one_box | numeric_close | (a custom reward) custom | failed


def reward(response: str, answer: str) -> float:
    """1.0 iff the final \\boxed{} of `response` equals `answer` mathematically, else 0.0."""
    return check(response, answer).reward


def check(response: str, answer: str, timeout: float = DEFAULT_TIMEOUT) -> Verdict:
    """The reward together with the extracted answer and the reason for the verdict."""
    if not isinstance(response, str) or not isinstance(answer, str):
        raise TypeError("response and answer must be str")
    found, reason = last_boxed(response)
    if found is None:
        return Verdict(0.0, None, reason)
    pred = clean(unwrap_boxes(found))
    if not pred:
        return Verdict(0.0, found, "empty_box")
    if nesting_depth(pred) > MAX_NESTING:
        return Verdict(0.0, found, "too_deeply_nested")
    gold = clean(unwrap_boxes(answer))  # both sides alike, and both paths see the cleaned strings
    decided = shortcut(pred, gold)
    if decided is not None:
        return Verdict(decided, pred, "exact_match" if decided else "not_equivalent")
    outcome = _WORKER.equivalent(gold, pred, timeout)
    return Verdict(1.0 if outcome == "equivalent" else 0.0, pred, outcome)


# ----------------------------------------------------------------------------- the official rule

NUMERIC_TOLERANCE = 1e-4  # the reference's relative tolerance for two numbers


def official_reward(response: str, answer: str) -> float:
    """The reference P2O code's DeepMath reward, as 1.0 or 0.0 (see official_check)."""
    return official_check(response, answer).reward


def official_check(response: str, answer: str, timeout: float = DEFAULT_TIMEOUT) -> Verdict:
    """The reference P2O DeepMath reward: 1 iff the response holds the text `\\boxed` exactly once
    and the box's content matches the answer.

    Accepted beyond `check`: with exactly one box, a box that `check` scores 0 still scores 1
    (reason 'numeric_close') when both answers read as plain decimal numbers (see plain_number)
    and the prediction is within relative 1e-4 of the gold value, of gold/100 or of gold*100 (the
    reference's percentage reading: `0.5` for `50`, `50` for `0.5`).
    Refused beyond `check`: any response in which `\\boxed` does not occur exactly once, counted as
    plain text like the reference does, so a `\\boxed` with no braces or a box inside a box
    counts too (reason 'not_one_box').

    Left out of the reference: its symbolic path (sympy's parse_expr, which evals, then sympy's
    parse_latex, then simplify(a - b) == 0 or numeric closeness); on model text we keep
    math-verify's LaTeX parser only, in the child, as `check` does. Also left out is the rest of
    its answer normaliser: case-insensitive text equality, units, `\\text{}`, `$`/`%` anywhere,
    `^\\circ`, words like "million", mixed numbers; any comma (it drops them all, reading `1,2` as
    12); tuples and intervals compared element by element. Its math-verify call reads the whole
    response, ours the box only, so a lone `\\boxed` without braces scores 0 here even where
    math-verify would find an answer elsewhere in the text; and where an `\\fbox{}` follows the one
    `\\boxed{}`, `check` reads the `\\fbox`.
    """
    if not isinstance(response, str) or not isinstance(answer, str):
        raise TypeError("response and answer must be str")
    if response.count("\\boxed") != 1:
        return Verdict(0.0, None, "not_one_box")
    verdict = check(response, answer, timeout)
    if verdict.reward or verdict.extracted is None:
        return verdict
    if numeric_close(verdict.extracted, clean(unwrap_boxes(answer))):
        return Verdict(1.0, verdict.extracted, "numeric_close")
    return verdict


def numeric_close(pred, gold):
    """True iff both strings read as plain numbers and pred is within relative NUMERIC_TOLERANCE of
    gold, gold/100 or gold*100.

    >>> numeric_close("0.5", "50\\%"), numeric_close("100.02", "100")
    (True, False)
    """
    p, g = plain_number(pred), plain_number(gold)
    if p is None or g is None:
        return False
    return any(math.isclose(p, x, rel_tol=NUMERIC_TOLERANCE) for x in (g, g / 100, g * 100))


# a sign, then digits (ungrouped, or in groups of three split by `,` or `{,}`) with an optional
# decimal part, or a bare decimal part (`.5`)
DECIMAL = re.compile(r"[+-]?(?:(?:[0-9]{1,3}(?:(?:,|\{,\})[0-9]{3})+|[0-9]+)(?:\.[0-9]+)?|\.[0-9]+)")


def plain_number(s):
    """The value of a plain decimal number, or None. Around it may be `$...$`, a leading `\\$` or
    `$` (money) and a trailing `%` or `\\%` (the number itself is kept: the percentage reading is
    numeric_close's). A strict grammar, not float(): float also reads `inf`, `nan`, `1e5`, `1_0`.

    >>> plain_number("$-1{,}234.5$"), plain_number("\\$7"), plain_number("12\\%"), plain_number("1,2")
    (-1234.5, 7.0, 12.0, None)
    """
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] == "$":
        s = s[1:-1].strip()
    for prefix in ("\\$", "$"):
        if s.startswith(prefix):
            s = s[len(prefix):].lstrip()
            break
    for suffix in ("\\%", "%"):
        if s.endswith(suffix):
            s = s[:-len(suffix)].rstrip()
            break
    if not DECIMAL.fullmatch(s):
        return None
    value = float(s.replace("{,}", "").replace(",", ""))
    return value if math.isfinite(value) else None  # 400 digits overflow to inf, and inf is close to inf


# ----------------------------------------------------------------------------- extraction

INTEGER = re.compile(r"[+-]?[0-9]+")


def _brace_group(text, start, limit):
    """Index just past the `}` closing the `{` at text[start], or None if not closed within
    `limit` characters. Escaped braces `\\{` `\\}` (LaTeX set braces) do not count."""
    depth, i, end = 0, start, min(len(text), start + limit + 2)
    while i < end:
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


BOX = re.compile(r"\\(?:boxed|fbox)\{")


def last_boxed(text):
    """Content of the last top-level \\boxed{}/\\fbox{} and 'ok', or (None, why). Linear time:
    the scan only moves forward, and an unclosed box ends it (everything after is inside it).

    >>> last_boxed("a \\boxed{1} b \\boxed{\\frac{2}{3}}")
    ('\\frac{2}{3}', 'ok')
    """
    found, reason, pos = None, "no_box", 0
    while (m := BOX.search(text, pos)) is not None:
        brace = m.end() - 1
        end = _brace_group(text, brace, MAX_ANSWER_CHARS)
        if end is None:  # longer than the cap, or never closed
            closed = _brace_group(text, brace, len(text))
            if closed is None:
                return None, "unclosed_box"
            found, reason, pos = None, "answer_too_long", closed
            continue
        found, reason, pos = text[brace + 1:end - 1], "ok", end  # nested boxes stay inside
    return found, reason


def unwrap_boxes(text):
    """Replace nested \\boxed{X} by X (bounded: at most MAX_NESTING rounds)."""
    for _ in range(MAX_NESTING):
        m = BOX.search(text)
        if m is None:
            break
        end = _brace_group(text, m.end() - 1, len(text))
        if end is None:
            break
        text = text[:m.start()] + text[m.end():end - 1] + text[end:]
    return text


def nesting_depth(text):
    depth = best = 0
    for c in text:
        if c in "([{":
            depth += 1
            best = max(best, depth)
        elif c in ")]}":
            depth -= 1
    return best


def clean(s):
    """An answer as both paths see it: outer whitespace and one trailing full stop removed (the
    sentence's punctuation: math-verify would not parse `\\frac{1}{2}.` at all). An ellipsis, `\\.`
    and the null delimiters `\\left.` `\\right.` keep their dot.

    >>> clean(" x=3. ")
    'x=3'
    """
    s = s.strip()
    if s.endswith(".") and not s.endswith(("..", "\\.", "\\left.", "\\right.")):
        s = s[:-1].rstrip()
    return s


_FRAC = re.compile(r"\\[dtc]frac(?![A-Za-z])")


def normalize(s):
    """The form the shortcut compares: `\\dfrac`/`\\tfrac`/`\\cfrac` spelt `\\frac` (math-verify's
    own first rewrite) and an integer written as its value (`004` -> `4`, `-0` -> `0`, `+7` -> `7`).
    Nothing else: math-verify gives whitespace and spacing macros meaning (`1 000` is 1*0,
    `32, 349` a set, `\\frac  1 2` unparsed), so any other difference is left to it."""
    s = _FRAC.sub(lambda m: "\\frac", s)
    if INTEGER.fullmatch(s):
        digits = s.lstrip("+-").lstrip("0")
        s = "-" + digits if digits and s[0] == "-" else digits or "0"
    return s


def shortcut(pred, gold):
    """1.0 or 0.0 where two cleaned answers are decided without sympy, else None: 1.0 for the same
    text up to how a fraction macro or an integer is spelt, 0.0 for two integers of different
    value. math-verify decides all of these the same way, except identical text it cannot parse
    (which it scores 0)."""
    p, g = normalize(pred), normalize(gold)
    if p == g:
        return 1.0
    if INTEGER.fullmatch(p) and INTEGER.fullmatch(g):
        return 0.0
    return None


# ----------------------------------------------------------------------------- the sympy child


def serve():
    """Child process loop: one JSON [gold, pred] per stdin line -> one JSON outcome per stdout
    line ('equivalent' | 'not_equivalent' | 'unparsable' | 'timeout'). math-verify runs in the
    child's main thread (its own signal timeouts work there) with the address space capped."""
    import resource  # the child's own imports, here rather than at the top: only the child needs them

    resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    from math_verify import LatexExtractionConfig, parse, verify  # after the cap: sympy's memory lives under it

    # LaTeX only: the ExprExtractionConfig fallback would call sympy's parse_expr (eval-based)
    config = [LatexExtractionConfig(boxed_match_priority=0, try_extract_without_anchor=True)]
    cache = {}

    def parsed(latex):
        if latex not in cache:
            if len(cache) > 10_000:
                cache.clear()
            cache[latex] = parse("$" + latex + "$", extraction_config=config, parsing_timeout=1)
        return cache[latex]

    print(json.dumps("ready"), flush=True)
    for line in sys.stdin:
        try:
            gold, pred = json.loads(line)
            g, p = parsed(gold), parsed(pred)
            if not g or not p:
                outcome = "unparsable"
            else:
                outcome = "equivalent" if verify(g, p, timeout_seconds=1) else "not_equivalent"
        except TimeoutError:
            outcome = "timeout"
        except Exception:  # noqa: BLE001 - any failure on untrusted input is a 0, never a crash
            outcome = "unparsable"
        print(json.dumps(outcome), flush=True)


class _Worker:
    """One lazily started child per process; calls from several threads are serialised.
    A child that overruns its time is killed and replaced on the next call."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc = None

    def _start(self):
        here = os.path.dirname(os.path.abspath(__file__))
        # a fresh interpreter (not multiprocessing): it must not re-import the caller's __main__
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "import verify; verify.serve()"], cwd=here,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True, bufsize=1)
        if self._read(STARTUP_TIMEOUT) != "ready":
            self._kill()
            raise RuntimeError("verify.py: the math-verify child process did not start")

    def _read(self, timeout):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else "worker_died"

    def _kill(self):
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def equivalent(self, gold, pred, timeout):
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
            try:
                self.proc.stdin.write(json.dumps([gold, pred]) + "\n")
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError):
                self._kill()
                return "worker_died"
            outcome = self._read(timeout)
            if outcome is None or outcome == "worker_died":
                self._kill()
                return "timeout" if outcome is None else outcome
            return outcome


_WORKER = _Worker()

REWARDS = {"ours": reward, "official": official_reward}  # the built-in rules, by --reward name
CHECKS = {"ours": check, "official": official_check}  # the same rules with their verdicts (eval.py)


# ----------------------------------------------------------------------------- any reward, by --reward


def load_reward(spec):
    """--reward -> check_fn(response, problem) -> Verdict, the one scorer of rollouts, dev
    evaluation, GEPA and eval.py. `spec`: 'ours' | 'official' (the rules above, against
    problem.answer), or 'module:function' / 'path/to/file.py:function': a Python callable
    (response: str, problem: data.Problem) -> a number (a bool counts). Mining, GEPA and pass@k
    count a response as solved when its reward is > 0 (pass@k assumes 0 or 1, as the built-in
    rules give; maj@k groups the votes by the last box's content, equal under the math rule);
    the Verdict of a callable holds its reward, the last \\boxed{} content as `extracted` (for
    maj@k and the logs) and reason 'custom'. A spec that does not load raises ValueError naming it.

        check_fn = load_reward("examples/short_answer.py:exact_match")
        check_fn("The capital is \\boxed{Paris}.", problem)   # problem.answer == "paris"
        -> Verdict(reward=1.0, extracted='Paris', reason='custom')
    """
    if spec in CHECKS:
        rule = CHECKS[spec]
        return lambda response, problem: rule(response, problem.answer)
    fn = load_callable(spec)

    def custom(response, problem):
        where = f"--reward={spec}"
        try:
            value = call_with_deadline(fn, (response, problem), POLICY["timeout"])
        except RewardTimeout:
            return failed(RewardError(f"{where} took more than {POLICY['timeout']:g} s on problem "
                                      f"{getattr(problem, 'id', '?')} (--reward_timeout)"), response)
        except Exception as e:  # noqa: BLE001 -- named, with the problem, then raised on or counted
            return failed(RewardError(f"{where} raised {type(e).__name__} on problem {getattr(problem, 'id', '?')}: "
                                      f"{e}"), response, e)
        if isinstance(value, np.bool_):  # numpy's bool is no numbers.Real; Python's bool is
            value = bool(value)
        if not isinstance(value, numbers.Real) or not math.isfinite(value):  # bool, int, float, numpy scalars
            return failed(RewardError(f"{where} returned {value!r} for problem {getattr(problem, 'id', '?')}; "
                                      "it must return a finite number"), response)
        return Verdict(float(value), last_boxed(response)[0], "custom")
    return custom


# What a custom reward's failures do (train.py's and eval.py's --reward_timeout, --reward_errors; set_policy):
# stop raises the failure naming the problem; zero scores 0 (reason 'failed') and counts it in FAILURES.
POLICY = {"timeout": 60.0, "on_error": "stop"}
REWARD_ERRORS = ("stop", "zero")
FAILURES = [0]  # custom-reward calls scored 0 by the 'zero' policy in this process (take_failures)


class RewardError(RuntimeError):
    """A custom reward that raised, ran out of time or returned no finite number."""


class RewardTimeout(Exception):
    """Raised in the main thread when a custom reward's call runs past --reward_timeout."""


def set_policy(timeout, on_error):
    if on_error not in REWARD_ERRORS:
        raise ValueError(f"--reward_errors is one of {' | '.join(REWARD_ERRORS)}, got {on_error!r}")
    POLICY.update(timeout=float(timeout), on_error=on_error)


def take_failures():
    """Custom-reward failures scored 0 since the last call (the 'zero' policy), then reset."""
    n, FAILURES[0] = FAILURES[0], 0
    return n


def failed(error, response, cause=None):
    if POLICY["on_error"] == "stop":
        raise error from cause
    FAILURES[0] += 1
    return Verdict(0.0, last_boxed(response)[0], "failed")


_DEADLINE = {"armed": False, "installed": False, "lock": threading.Lock()}


def _on_deadline(signum, frame):
    if _DEADLINE["armed"]:  # a late signal, after the call ended, is ignored
        _DEADLINE["armed"] = False
        raise RewardTimeout


def call_with_deadline(fn, args, seconds):
    """fn(*args), ended with RewardTimeout after `seconds` of wall time. A timer thread signals the
    main thread with SIGUSR1 (not SIGALRM: a reward's own timeouts use that timer, math-verify's
    among them), whose handler raises between two bytecodes, a sleep included; a call stuck inside
    one C call is ended when it returns. The handler stays installed (a signal that arrives late
    is ignored, never fatal). Off the main thread, or with seconds <= 0, there is no bound."""
    if seconds <= 0 or threading.current_thread() is not threading.main_thread():
        return fn(*args)
    if not _DEADLINE["installed"]:
        signal.signal(signal.SIGUSR1, _on_deadline)
        _DEADLINE["installed"] = True

    def fire():
        with _DEADLINE["lock"]:
            if _DEADLINE["armed"]:
                signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    _DEADLINE["armed"] = True
    timer.start()
    try:
        return fn(*args)
    finally:
        with _DEADLINE["lock"]:
            _DEADLINE["armed"] = False
        timer.cancel()


def reward_scorer(cfg, problems):
    """--reward (cfg.reward: config.Config's or eval.py's) as check_fn(response, problem) -> Verdict, tried once on the first problem's
    gold answer (boxed) so that a function that raises or returns no number is one line at start-up,
    whatever --reward_errors says; later calls follow cfg's --reward_timeout and --reward_errors."""
    check_fn = load_reward(cfg.reward)
    if problems:
        set_policy(getattr(cfg, "reward_timeout", POLICY["timeout"]), "stop")
        try:
            check_fn(f"The answer is \\boxed{{{problems[0].answer}}}.", problems[0])
        except (ValueError, RuntimeError) as e:
            raise SystemExit(f"{e} (tried at start-up on its gold answer)") from None
    set_policy(getattr(cfg, "reward_timeout", POLICY["timeout"]), getattr(cfg, "reward_errors", "stop"))
    return check_fn


def load_callable(spec):
    """'module:function' (importable; the repository's root is on the path) or
    'path/to/file.py:function' -> the callable, loaded once a process (a module that loads a judge
    at import does so once); ValueError naming the spec otherwise."""
    import importlib
    import importlib.util

    if spec in _LOADED:
        return _LOADED[spec]
    source, _, name = spec.rpartition(":")
    if not source or not name:
        raise ValueError(f"--reward is one of {' | '.join(map(repr, CHECKS))} | module:function | "
                         f"path/to/file.py:function, got {spec!r}")
    try:  # what the module prints goes to stderr: stdout may be --dry_run's JSON
        with contextlib.redirect_stdout(sys.stderr):
            if source.endswith(".py"):
                module_spec = importlib.util.spec_from_file_location(os.path.basename(source)[:-3], source)
                if module_spec is None or not os.path.isfile(source):
                    raise FileNotFoundError(f"no file {source}")
                module = importlib.util.module_from_spec(module_spec)
                module_spec.loader.exec_module(module)
            else:
                module = importlib.import_module(source)
    except Exception as e:  # noqa: BLE001 -- whatever the module raises while importing: one line
        raise ValueError(f"--reward={spec}: cannot import {source} ({type(e).__name__}: {e})") from None
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"--reward={spec}: {source} has no callable {name!r}")
    _LOADED[spec] = fn
    return fn


_LOADED = {}  # spec -> callable (load_callable)

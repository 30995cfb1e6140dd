"""Teacher-Ref over an OpenAI-compatible server (rollout.OpenAIReflector, train.gepa_round):
against a scripted HTTP server (retries, garbage, refusals, the key), then against vLLM's own
OpenAI-compatible server on the default model: one GEPA round through it, and one whose server is
killed mid-round."""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

import train
from data import Problem
from rollout import OpenAIReflector, ReflectorError, Sample


class Scripted(BaseHTTPRequestHandler):
    """/models lists one model; /chat/completions answers from `script` (one entry per request:
    an HTTP status, 'garbage', a text, or a dict: the choice's message, its finish reason under
    "finish_reason"), then repeats the last entry."""
    script, seen = [], []

    def log_message(self, *args):
        pass

    def _send(self, code, body):
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._send(200, {"data": [{"id": "teacher-1"}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Scripted.seen.append((body, self.headers.get("Authorization")))
        entry = Scripted.script.pop(0) if len(Scripted.script) > 1 else Scripted.script[0]
        if isinstance(entry, int):
            self._send(entry, {"error": "scripted"})
        elif entry == "garbage":
            self._send(200, "<html>not json</html>")
        elif isinstance(entry, dict):
            message = {k: v for k, v in entry.items() if k != "finish_reason"}
            self._send(200, {"choices": [{"message": message, "finish_reason": entry.get("finish_reason", "stop")}],
                             "usage": {"completion_tokens": 7}})
        else:
            self._send(200, {"choices": [{"message": {"content": entry}, "finish_reason": "stop"}],
                             "usage": {"completion_tokens": 7}})


@pytest.fixture
def server():
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Scripted)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    Scripted.seen.clear()
    yield f"http://127.0.0.1:{httpd.server_address[1]}/v1"
    httpd.shutdown()


def test_a_reflection_round_trip_with_retries_and_the_key(server, monkeypatch):
    monkeypatch.setenv("TEACHER_KEY", "sk-secret")
    Scripted.script[:] = [503, 429, "<template>Check units.</template>"]
    counts = Counter()
    teacher = OpenAIReflector(server, api_key_env="TEACHER_KEY", retries=3, backoff=0.01, temperature=0.8,
                              max_tokens=50, seed=5, counts=counts)
    assert teacher.model == "teacher-1"
    assert teacher.reflect(["improve this"]) == [("<template>Check units.</template>", True)]
    assert len(Scripted.seen) == 3  # two retried failures, then the answer
    body, auth = Scripted.seen[-1]
    assert auth == "Bearer sk-secret" and body["model"] == "teacher-1" and body["max_tokens"] == 50
    assert body["messages"] == [{"role": "user", "content": "improve this"}] and body["seed"] == 5
    assert (teacher.calls, teacher.failures, teacher.tokens) == (1, 0, 7)
    assert counts == Counter(teacher_tokens=7, teacher_failures=0)
    Scripted.script[:] = ["<template>a</template>", "<template>b</template>"]
    teacher.reflect(["one", "two"])  # the next call's seeds continue after the first call's
    assert sorted(body["seed"] for body, _ in Scripted.seen[-2:]) == [6, 7]
    assert "sk-secret" not in repr(vars(train.Config(reflector=server)))  # only the variable's name is configured


@pytest.mark.parametrize("script, requests", [([503], 3), (["garbage"], 1), ([400], 1)])
def test_failed_calls_are_counted_and_skipped(server, script, requests):
    Scripted.script[:] = script
    teacher = OpenAIReflector(server, retries=2, backoff=0.01)
    assert teacher.reflect(["a"]) == [None]
    assert len(Scripted.seen) == requests  # 5xx retried (1 + 2), garbage and 4xx not
    assert (teacher.calls, teacher.failures, teacher.tokens) == (1, 1, 0)


def test_sampling_and_chat_template_fields_are_sent_only_when_set(server):
    """top_p below 1, top_k above 0 and chat_template_kwargs go in the body (vLLM's server reads
    them); at their neutral values nothing is sent, so the server's own defaults stand."""
    Scripted.script[:] = ["<template>a</template>"]
    OpenAIReflector(server, retries=0).reflect(["p"])
    body, _ = Scripted.seen[-1]
    assert set(body) == {"model", "messages", "temperature", "max_tokens", "seed"}
    thinking = {"enable_thinking": True}
    OpenAIReflector(server, retries=0, top_p=0.95, top_k=20, chat_template_kwargs=thinking).reflect(["p"])
    body, _ = Scripted.seen[-1]
    assert (body["top_p"], body["top_k"], body["chat_template_kwargs"]) == (0.95, 20, {"enable_thinking": True})


@pytest.mark.parametrize("message, reply", [
    ({"content": None, "reasoning_content": "Plan: ```\nAdd units.\n```", "finish_reason": "length"},
     ("Plan: ```\nAdd units.\n```", False)),  # vLLM 0.11's field: an unfinished thought
    ({"content": None, "reasoning": "Think more.", "finish_reason": "stop"}, ("Think more.", True)),  # newer vLLM
    ({"content": "```\nA\n```", "reasoning_content": "Plan."}, ("```\nA\n```", True)),  # content wins
    ({"content": None}, None),  # nothing at all: a failed call
])
def test_a_null_content_falls_back_to_the_thought(server, message, reply):
    Scripted.script[:] = [message]
    assert OpenAIReflector(server, retries=0).reflect(["p"]) == [reply]


def test_make_reflector_sends_the_reflector_settings_to_a_server(server):
    Scripted.script[:] = ["```\nA\n```"]
    cfg = train.Config(reflector=server, reflect_top_p=0.95, reflect_top_k=20, reflector_retries=0,
                       reflect_chat_template_kwargs='{"enable_thinking": true}', chat_template_kwargs='{"x": 1}')
    train.make_reflector(cfg, None, None, None, Counter()).reflect(["p"])
    body, _ = Scripted.seen[-1]
    assert (body["top_p"], body["top_k"], body["chat_template_kwargs"]) == (0.95, 20, {"enable_thinking": True})
    train.make_reflector(train.Config(reflector=server, chat_template_kwargs='{"x": 1}'), None, None, None,
                         Counter()).reflect(["p"])
    body, _ = Scripted.seen[-1]  # '' sends nothing: the policy's chat_template_kwargs are not the teacher's
    assert "chat_template_kwargs" not in body and "top_k" not in body and "top_p" not in body


def test_an_unreachable_or_wrong_server_is_a_clear_error(server):
    with socket.socket() as s:  # a port with nothing behind it
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ReflectorError, match=f"127.0.0.1:{port}/v1: unreachable"):
        OpenAIReflector(f"http://127.0.0.1:{port}/v1", timeout=2)
    with pytest.raises(ReflectorError, match="serves \\['teacher-1'\\], not 'gpt-x'"):
        OpenAIReflector(server, model="gpt-x")
    cfg = train.Config(reflector=f"http://127.0.0.1:{port}/v1", reflector_timeout=2)
    with pytest.raises(SystemExit, match="unreachable"):
        train.make_reflector(cfg, None, None, None, Counter())


# ----------------------------------------------------------------------------- vLLM's server


class Answers:
    """The policy's greedy answers in a GEPA round: correct only under a template that says 'unit'."""
    def generate(self, prompts, n=1, **_):
        out = []
        for messages in prompts:
            text = messages[-1]["content"]
            right = "unit" in text.lower().split("\n\n")[0] and "\n\n" in text
            answer = "\\boxed{14}" if right else "\\boxed{3}"
            out.append([Sample([1], [2, 3], answer, "stop")])
        return out


def hard_items(n=12):
    return [Problem(f"h{i}", f"How many blarps are in {i + 2} zogs?", "14") for i in range(n)]


@pytest.fixture(scope="module")
def vllm_server(model_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path, "--port", str(port),
           "--host", "127.0.0.1", "--max-model-len", "2048", "--dtype", "bfloat16", "--served-model-name", "smol"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    url = f"http://127.0.0.1:{port}/v1"
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            urllib.request.urlopen(url + "/models", timeout=2).read()
            break
        except OSError:
            if proc.poll() is not None:
                pytest.fail(f"vLLM's server exited with {proc.returncode}")
            time.sleep(2)
    else:
        proc.kill()
        pytest.fail("vLLM's server did not start in 300 s")
    yield url, proc
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def gepa_cfg(url, **over):
    settings = dict(reflector=url, reflector_timeout=120, reflector_retries=2, gepa_budget=40, gepa_parents=2,
                    gepa_minibatch=2, reflect_max_tokens=60)
    return train.Config(**{**settings, **over})


def test_one_gepa_round_reflects_through_vllms_openai_server(vllm_server):
    url, _ = vllm_server
    counts = Counter()
    cfg = gepa_cfg(url)
    res = train.gepa_round(cfg, 0, hard_items(), Answers(), train.make_reflector(cfg, None, None, None, counts),
                           counts, reward_fn=lambda text, item: float("14" in text))
    assert counts["reflection_calls"] == res.reflection_calls >= 2
    assert counts["teacher_tokens"] > 0 and counts["teacher_failures"] == 0
    assert counts["reflection_tokens"] == 0  # the teacher's tokens are not policy compute
    assert all(e["outcome"] in ("accepted", "rejected", "skipped_all_correct") for e in res.log)
    assert not any(e.get("reason") == "call_failed" for e in res.log)
    assert res.metric_calls <= 40


def test_killing_the_server_mid_round_loses_nothing(vllm_server):
    url, proc = vllm_server
    counts = Counter()
    killed = threading.Event()

    def kill_after_first_reflection():
        while counts["reflection_calls"] == 0:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)
        killed.set()

    threading.Thread(target=kill_after_first_reflection, daemon=True).start()
    cfg = gepa_cfg(url, gepa_budget=80)
    res = train.gepa_round(cfg, 0, hard_items(20), Answers(), train.make_reflector(cfg, None, None, None, counts),
                           counts, reward_fn=lambda text, item: float("14" in text))
    assert killed.is_set()
    failed = [e for e in res.log if e.get("reason") == "call_failed"]
    assert failed and counts["teacher_failures"] == len(failed) == res.rejections["call_failed"]
    assert res.metric_calls <= 80 and res.assignment is not None  # the round finished

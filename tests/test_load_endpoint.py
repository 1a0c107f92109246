"""`load --endpoint`: servers already running, loaded over the OpenAI completions API (fake ones here, on loopback;
llama-servers in test_load.py)."""
from __future__ import annotations

import http.client
import json
import math
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pandas as pd
import pytest

from lssp.engines.endpoint import counters, endpoint_counters, parse_endpoints, stream_completion
from lssp.errors import UserError
from lssp.measure.load_llamacpp import request_timing


class FakeServer:
    """An OpenAI-compatible completions server on 127.0.0.1: each request's token i is " w{(sum(prompt) + i) % 97}",
    streamed ``per_event`` tokens per event every ``delay_s``; a speculating one (``per_event`` > 1) counts its
    drafts in vLLM's /metrics names. ``usage``: whether the last event says the token count; ``fail_after``: requests
    answered before it answers HTTP 500; ``shift``: added to every token (another model)."""

    def __init__(self, per_event: int = 1, delay_s: float = 0.004, usage: bool = True, fail_after: int = -1,
                 shift: int = 0, model: str = "fake/model", salt: int = 0, skew: float = 0.0, answer=None,
                 key: str = "", also: tuple[str, ...] = (), tokenize=None, traffic: int = 0,
                 forward: FakeServer | None = None, metrics: bool = True, details: bool = False,
                 takes_text: bool = False) -> None:
        self.per_event, self.delay_s, self.usage, self.fail_after, self.shift = per_event, delay_s, usage, fail_after, shift
        self.salt, self.skew = salt, skew  # sampled: another random stream; the law of tokens after the first skewed
        self.answer = answer  # the text to write, from the prompt's ids, one character per token (else the words)
        self.key, self.also = key, also  # a key /v1/ asks for (Bearer); more model ids it lists after its own
        self.tokenize = tokenize  # text -> ids at POST /tokenize (None: no such route)
        self.traffic = traffic  # drafting steps (one accepted draft each) someone else's requests add per /metrics read
        self.forward = forward  # a gateway: completions passed on to this server (under its model id), streamed back
        self.metrics, self.details = metrics, details  # /metrics; drafts in the usage (completion_tokens_details)
        self.takes_text, self.prompts = takes_text, []  # a text prompt only (HTTP 400 for ids); the prompts it got
        self.model, self.served, self.drafts, self.drafted, self.accepted = model, 0, 0, 0, 0
        self.lock = threading.Lock()
        self.http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.http.daemon_threads = True
        threading.Thread(target=self.http.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.http.server_port}"

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:  # quiet
                pass

            def _json(self, payload, status: int = 200) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _refused(self) -> bool:
                if fake.key and self.path.startswith("/v1/") and \
                        self.headers.get("Authorization") != f"Bearer {fake.key}":
                    self._json({"error": "unauthorized"}, 401)
                    return True
                return False

            def do_GET(self) -> None:
                if self._refused():
                    return
                if self.path == "/v1/models":
                    self._json({"data": [{"id": name} for name in (fake.model, *fake.also)]})
                elif self.path == "/version":
                    self._json({"version": "0.0-fake"})
                elif self.path == "/metrics" and fake.per_event > 1 and fake.metrics:
                    with fake.lock:
                        fake.drafts, fake.drafted = fake.drafts + fake.traffic, fake.drafted + 2 * fake.traffic
                        fake.accepted += fake.traffic
                    text = "".join(f"vllm:spec_decode_num_{name}_total{{engine=\"0\"}} {value}\n" for name, value in
                                   (("drafts", fake.drafts), ("draft_tokens", fake.drafted),
                                    ("accepted_tokens", fake.accepted)))
                    text += "".join(f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} '
                                    f"{fake.drafts if i < fake.per_event - 1 else 0}\n" for i in range(fake.per_event))
                    data = text.encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    self._json({"error": "not found"}, 404)

            def do_POST(self) -> None:
                if self.path == "/tokenize":
                    body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                    if fake.tokenize is None:
                        self._json({"error": "not found"}, 404)
                    else:
                        self._json({"tokens": fake.tokenize(body["prompt"])})
                    return
                try:
                    self._complete()
                except (BrokenPipeError, ConnectionResetError):  # the client dropped the stream (cancelled)
                    pass

            def _complete(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self._refused():
                    return
                with fake.lock:
                    fake.served += 1
                    failing = 0 <= fake.fail_after < fake.served
                if failing:
                    self._json({"error": {"message": "engine died"}}, 500)
                    return
                chat = self.path == "/v1/chat/completions"  # the conversation: its text as the prompt
                if chat:
                    body["prompt"] = "".join(m["content"] for m in body["messages"])
                elif isinstance(body["prompt"], list) == fake.takes_text:
                    self._json({"error": {"message": "prompt must be a string" if fake.takes_text else "ids"}}, 400)
                    return
                fake.prompts.append(body.get("messages") or body["prompt"])
                assert body["stream"] and body["model"] in (fake.model, *fake.also)
                if fake.forward is not None:
                    self._forward(body)
                    return
                fake.asked = body["model"]
                prompt = [ord(c) for c in body["prompt"]] if fake.takes_text or chat else body["prompt"]
                n, start = body["max_tokens"], sum(prompt) + fake.shift
                words = [f" w{(start + i) % 97}" for i in range(n)]
                if body.get("temperature", 0) > 0:  # letters a-d, a 3 times as likely as each other; skew: more after the first
                    draw = random.Random(body["seed"] * 7919 + fake.salt)
                    words = [draw.choices("abcd", [3 + (fake.skew if i else 0), 1, 1, 1])[0] for i in range(n)]
                if fake.answer is not None:
                    words = list(fake.answer(body["prompt"]))[:n]
                    n = len(words)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for i in range(0, n, fake.per_event):
                    time.sleep(fake.delay_s)
                    said = "".join(words[i:i + fake.per_event])
                    event = {"choices": [{"index": 0, **({"delta": {"content": said}} if chat else {"text": said})}]}
                    self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
                    self.wfile.flush()
                    if fake.per_event > 1:
                        with fake.lock:
                            fake.drafts += 1
                            fake.drafted += fake.per_event
                            fake.accepted += fake.per_event - 1
                if fake.usage:
                    usage = {"choices": [], "usage": {"completion_tokens": n, "prompt_tokens": len(body["prompt"])}}
                    if fake.details:  # each event: per_event drafts made, all but one kept
                        steps = -(-n // fake.per_event)
                        usage["usage"]["completion_tokens_details"] = {
                            "accepted_prediction_tokens": steps * (fake.per_event - 1), "rejected_prediction_tokens": steps}
                    self.wfile.write(f"data: {json.dumps(usage)}\n\n".encode())
                self.wfile.write(b"data: [DONE]\n\n")

            def _forward(self, body) -> None:
                upstream = http.client.HTTPConnection("127.0.0.1", int(fake.forward.url.rsplit(":", 1)[1]))
                upstream.request("POST", "/v1/completions", json.dumps({**body, "model": fake.forward.model}),
                                 {"Content-Type": "application/json"})
                response = upstream.getresponse()
                self.send_response(response.status)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                for line in response:
                    self.wfile.write(line)
                    self.wfile.flush()
                upstream.close()

        return Handler


@pytest.fixture
def servers():
    started: list[FakeServer] = []

    def start(**kwargs) -> FakeServer:
        started.append(FakeServer(**kwargs))
        return started[-1]
    yield start
    for server in started:
        server.close()


def test_endpoints_are_label_equals_url_one_rsp_each_label_once():
    rsp, eagle = parse_endpoints(["rsp=http://h:8000/v1/", "eagle=https://gateway.example/llm"])
    assert (rsp.url, rsp.mode.mode) == ("http://h:8000", "rsp")
    assert (eagle.url, eagle.mode.mode, eagle.mode.draft) == ("https://gateway.example/llm", "ssp", "eagle")
    for values, said in ((["rsp:http://h"], "give LABEL=URL"), (["rsp=h:8000", "x=http://h"], "http:// or https://"),
                         (["rsp=http://h:port", "x=http://h"], "port is not a number"),
                         (["a=http://h", "b=http://h"], "one labelled rsp"), (["rsp=http://h"], "one labelled rsp"),
                         (["rsp=http://h", "x=http://h", "x=http://g"], "each label once")):
        with pytest.raises(UserError, match=said):
            parse_endpoints(values)


def test_a_stream_is_timed_per_event_and_counted_from_the_usage(servers):
    fast = servers(per_event=2)
    out = stream_completion(fast.url, {"model": "fake/model", "prompt": [1, 2], "max_tokens": 5, "stream": True})
    assert not out.error and out.token_count == 5 and len(out.arrivals) == 3 and out.text == " w3 w4 w5 w6 w7"
    assert out.arrivals == sorted(out.arrivals) and request_timing(out, 0).tokens == 5
    bare = servers(usage=False)
    out = stream_completion(bare.url, {"model": "fake/model", "prompt": [1], "max_tokens": 4, "stream": True})
    assert out.token_count == 4 and out.timings["counted_events"]  # one event each here
    assert counters(fast.url).draft_tokens == 6 and counters(bare.url) is None  # no speculative counters
    slow = servers(delay_s=0.05)
    cancel, begun = threading.Event(), time.perf_counter()
    threading.Timer(0.12, cancel.set).start()  # Ctrl-C's doing: the stream in flight is dropped, not read to its end
    out = stream_completion(slow.url, {"model": "fake/model", "prompt": [1], "max_tokens": 100, "stream": True},
                            cancel=cancel)
    assert out.error == "cancelled" and time.perf_counter() - begun < 1.0 and 1 <= len(out.arrivals) < 10
    down = stream_completion("http://127.0.0.1:1", {})
    assert down.error.startswith("ConnectionRefusedError")


def test_load_through_endpoints_times_each_server_and_reads_its_counters(run, servers, tmp_path):
    rsp, fast = servers(delay_s=0.004), servers(per_event=2, delay_s=0.005)
    code, out, err = run("load", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"fast={fast.url}/v1",
                         "--concurrency", "1,2", "--requests", "6", "--max-new-tokens", "8", "--task", "stories",
                         "--repeats", "2", "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    said = " ".join(out.split())
    assert max(len(line) for line in out.splitlines()) <= 80
    assert f"rsp = {rsp.url} (model fake/model, version 0.0-fake)" in said
    assert "Warm-up, greedy: every SSp server wrote rsp's text" in said
    rows = pd.read_csv(tmp_path / "results" / "load.csv")
    assert set(rows["engine"]) == {"endpoint"} and set(rows["label"]) == {"RSp", "SSp fast"}
    assert rows["device"].str.startswith("remote servers (their hardware is not known here; client: ").all()
    assert (rows["completed"] == 12).all() and (rows["output_tokens"] == 96).all() and (rows["passes"] == 2).all()
    assert rows["others_cpu_share"].isna().all() and not rows["noisy"].any()  # the servers may run here: not checked
    ssp = rows[rows["mode"] == "ssp"]
    assert (ssp["latency_ratio"] > 1.2).all(), ssp  # two tokens per 5 ms against one per 4 ms
    assert ssp["acceptance_rate"].tolist() == pytest.approx([0.5, 0.5])  # the fake's counters: 1 of 2 per event
    assert (ssp["method"] == "remote").all() and rows["engine_version"].str.contains("fast: 0.0-fake").all()
    assert "lat× 95% intervals, SSp fast: c=1 " in out and "thr× 95% intervals, SSp fast: c=1 " in out
    assert (ssp["same_as_rsp"] == 1.0).all() and ssp["throughput_ratio_low"].notna().all()  # texts paired by pass
    summary = json.loads((tmp_path / "e.json").read_text())
    assert summary["levels"] == [1, 2] and summary["engine"] == "endpoint"


def test_endpoint_troubles_are_one_line_and_keep_the_levels_done(run, servers, tmp_path):
    rsp = servers()
    code, _, err = run("load", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", "x=http://127.0.0.1:1",
                       "--requests", "2", "--concurrency", "1")
    assert code == 2 and "--endpoint x: http://127.0.0.1:1 did not answer /v1/models" in err and len(err.splitlines()) == 1
    for extra, said in ((["--k", "3"], "--k would be the servers' own settings"),
                        (["--engine", "ours"], "--engine ours does not go with it")):
        code, _, err = run("load", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"y={rsp.url}", *extra)
        assert code == 2 and said in err, err
    code, _, err = run("load", "--engine", "endpoint")
    assert code == 2 and "name the servers with --endpoint LABEL=URL" in err
    # A server that breaks down at concurrency 2 (its 1 + 4 requests answered, warm-up included): level 1 is kept.
    dying, other = servers(per_event=2, fail_after=5), servers(shift=1, usage=False)
    code, out, err = run("load", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"dying={dying.url}",
                         "--endpoint", f"other={other.url}", "--requests", "4", "--concurrency", "1,2",
                         "--max-new-tokens", "4", "--task", "stories")
    assert code == 2 and "--endpoint dying" in err and "at concurrency 2" in err and "level completed" in err, err
    said = " ".join(out.split())
    assert "Warm-up, greedy: other wrote other text than rsp" in said  # another model: said, not refused
    assert "counted as streamed events" in said
    rows = pd.read_csv(tmp_path / "results" / "load.csv")
    assert list(rows["concurrency"].unique()) == [1]
    other_row = rows[rows["label"] == "SSp other"].iloc[0]
    assert math.isnan(other_row["acceptance_rate"])  # no counters at its /metrics
    assert other_row["same_as_rsp"] == 0.0 and rows[rows["label"] == "SSp dying"].iloc[0]["same_as_rsp"] == 1.0


def test_endpoints_under_poisson_arrivals_last_at_least_until_the_last_arrival(run, servers, tmp_path):
    from lssp.measure.load import poisson_arrivals

    rsp, fast = servers(delay_s=0.001), servers(per_event=2, delay_s=0.001)
    code, out, err = run("load", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"fast={fast.url}",
                         "--concurrency", "2", "--requests", "5", "--max-new-tokens", "4", "--task", "stories",
                         "--request-rate", "20", "--json", str(tmp_path / "open.json"))
    assert code == 0, err
    summary = json.loads((tmp_path / "open.json").read_text())
    last = poisson_arrivals(5, 20.0, summary["rows"][0]["seed"])[-1]
    assert all(row["wall_s"] >= last for row in summary["rows"]) and "Poisson" in out


def test_verify_endpoints_tells_a_server_of_the_same_law_from_a_skewed_one(run, servers, tmp_path):
    """Sampled, each SSp server's tokens against the RSp server's: another random stream of the same law passes
    (LOSSLESS, power enough at 400 runs), a law skewed after the first token fails (NOT LOSSLESS, exit 1); greedy
    and the options that are the servers' own are refused in one line."""
    rsp, same, skewed = servers(delay_s=0), servers(delay_s=0, salt=1), servers(delay_s=0, salt=2, skew=12.0)
    code, out, err = run("verify", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"same={same.url}",
                         "--temperature", "0.7", "--nb-prompts", "1", "--depth", "3", "--samples", "400",
                         "--json", str(tmp_path / "v.json"))
    assert code == 0, out + err
    assert "same: LOSSLESS" in out and max(len(line) for line in out.splitlines()) <= 80
    rows = pd.read_csv(tmp_path / "results" / "verify-endpoint.csv")
    assert list(rows["position"]) == [0, 1, 2] and rows["passed"].all() and (rows["power"][:2] >= 0.8).all()
    assert rows["device"].str.startswith("remote servers").all() and rows["run_id"].nunique() == 1
    summary = json.loads((tmp_path / "v.json").read_text())
    assert summary["temperature"] == 0.7 and summary["audits"][0]["verdict"] == "lossless"
    assert len(summary["audits"][0]["checks"]) == 3 and summary["run_id"] == rows["run_id"][0]
    code, out, err = run("verify", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"skewed={skewed.url}",
                         "--temperature", "0.7", "--nb-prompts", "1", "--depth", "3", "--samples", "400")
    assert code == 1 and "skewed: NOT LOSSLESS" in out, out + err
    for extra, said in ((["--temperature", "0"], "at a temperature above 0"), (["--k", "2"], "--k would be")):
        code, _, err = run("verify", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"x={same.url}", *extra)
        assert code == 2 and said in err, err


def test_latency_through_endpoints_times_each_server_one_request_at_a_time(run, servers, tmp_path):
    """``latency --endpoint``: the servers as modes of one interleaved run, named by their labels; ms/token from the
    streamed events over the servers' token counts, acceptance and tokens per forward from the counter deltas of each
    completion, the verdict with its interval, rows that say the servers' hardware is not known."""
    rsp, fast, other = servers(delay_s=0.004), servers(per_event=2, delay_s=0.005), servers(shift=1, delay_s=0.001)
    code, out, err = run("latency", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"fast={fast.url}",
                         "--endpoint", f"other={other.url}", "--nb-prompts", "4", "--max-new-tokens", "8",
                         "--ignore-eos", "--wide", "--json", str(tmp_path / "l.json"))
    assert code == 0, err
    assert "greedy SSp's text equal to RSp's: endpoint fast 100%, endpoint other 0%" in " ".join(out.split()), out
    assert max(len(line) for line in out.splitlines()) <= 80
    said = " ".join(out.split())
    assert "verdict: use endpoint other: " in said and "busy machine" not in said, out  # the fastest...
    assert "its greedy text differed from RSp's on 100% of completions" in said  # ...is not the same model
    rows = pd.read_csv(tmp_path / "results" / "latency.csv").set_index("draft", drop=False)
    assert rows.loc["fast", "same_as_rsp"] == 1.0 and rows.loc["other", "same_as_rsp"] == 0.0
    rows = rows[rows["draft"] != "other"].set_index("mode")
    assert set(rows["engine"]) == {"endpoint"} and rows.loc["ssp", "draft"] == "fast"
    assert rows.loc["ssp", "method"] == "server" and rows.loc["rsp", "method"] == "none"
    assert rows["device"].str.startswith("remote servers (their hardware is not known here; client: ").all()
    assert rows["others_cpu_share"].isna().all()  # the servers may run here: not checked
    # 8 tokens: the first event, then 7 more over 3 more events; two tokens per 5 ms against one per 4 ms
    assert rows.loc["rsp", "ms_per_token"] == pytest.approx(4.0, rel=0.5)
    assert rows.loc["ssp", "speedup"] > 1.2 and rows.loc["ssp", "speedup_low"] == rows.loc["ssp", "speedup_low"]
    assert rows.loc["ssp", "acceptance_rate"] == pytest.approx(0.5)  # the fake's counters: 1 of 2 per event
    assert rows.loc["ssp", "mean_accepted"] == pytest.approx(8 / 5)  # 8 tokens, 1 + 4 drafting steps, none undrafted
    assert rows.loc["ssp", "alpha"] == pytest.approx(0.5)  # position 0 always kept, position 1 never
    assert rows.loc["ssp", "k"] == 0 and rows.loc["ssp", "k_seen"] == 2  # the mode is its name; K from its counters
    prompts = pd.read_csv(tmp_path / "results" / "latency_prompts.csv")
    assert len(prompts) == 12 and set(prompts["draft"].dropna()) == {"fast", "other"}


def test_latency_endpoint_refuses_the_servers_settings_in_one_line(run, servers):
    rsp = servers()
    for extra, said in ((["--k", "3"], "--k would be the servers' own settings"),
                        (["--engine", "vllm"], "--engine would be the servers' own settings"),
                        (["--draft", "x"], "--draft would be")):
        code, _, err = run("latency", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"y={rsp.url}", *extra)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err
    code, _, err = run("latency", "--endpoint", f"rsp={rsp.url}")
    assert code == 2 and "one labelled rsp" in err
    code, _, err = run("latency", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", "x=http://127.0.0.1:1")
    assert code == 2 and "did not answer /v1/models" in err and len(err.strip().splitlines()) == 1


def _problem(ids: list[int]) -> tuple[int, int]:
    """The last "a * b = " of a prompt in the tiny models' character tokenizer (id 3 + the character's index)."""
    import re

    from conftest import CHARS

    text = "".join(CHARS[i - 3] for i in ids if 3 <= i < 3 + len(CHARS))
    a, b = re.findall(r"(\d+) \* (\d+) = ", text)[-1]
    return int(a), int(b)


def test_eval_through_endpoints_finds_a_server_whose_answers_are_worse(run, servers, tmp_path):
    """``eval --endpoint``: two servers scored on the same problems, paired; one that answers every problem right
    against one that gets those with an even a wrong: the difference's interval excludes 0, McNemar says so."""
    right = servers(answer=lambda ids: f"{_problem(ids)[0] * _problem(ids)[1]}\n9")
    wrong = servers(per_event=2, answer=lambda ids: f"{_problem(ids)[0] * _problem(ids)[1] + (_problem(ids)[0] % 2 == 0)}\n")
    code, out, err = run("eval", "tiny-target", "--endpoint", f"rsp={right.url}", "--endpoint", f"half={wrong.url}",
                         "--nb-prompts", "40", "--json", str(tmp_path / "e.json"))
    assert code == 0, err
    said = " ".join(out.split())
    assert "on servers already running" in said and "excludes 0: SSp and RSp differ" in said, out
    assert max(len(line) for line in out.splitlines()) <= 80
    rows = pd.read_csv(tmp_path / "results" / "eval.csv").set_index("mode")
    assert rows.loc["rsp", "success_rate"] == 1.0 and 0.2 < rows.loc["ssp", "success_rate"] < 0.8
    assert rows["device"].str.startswith("remote servers").all() and rows["others_cpu_share"].isna().all()
    for extra, said in ((["--k", "3"], "--k would be the servers' own settings"),
                        (["--rsp-batch", "4"], "--rsp-batch would be"),
                        (["--endpoint", f"third={wrong.url}"], "compares two servers")):
        code, _, err = run("eval", "tiny-target", "--endpoint", f"rsp={right.url}", "--endpoint", f"half={wrong.url}",
                           *extra)
        assert code == 2 and said in err and len(err.strip().splitlines()) == 1, err


def test_compare_streams_two_endpoints_side_by_side(run, servers):
    """``compare --endpoint``: RSp's server then the SSp one, each answer streamed as its events come, the speedup
    per prompt and over all; the servers' settings and a third server refused in one line."""
    rsp, fast = servers(delay_s=0.004), servers(per_event=2, delay_s=0.005)
    code, out, err = run("compare", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"fast={fast.url}",
                         "--prompt", "hello", "--prompt", "a cat", "--max-new-tokens", "8", "--ignore-eos")
    assert code == 0, err
    said = " ".join(out.split())
    assert "helped by the server 'fast' (its own drafts, not coloured)" in said and "on servers already running" in said, out
    assert said.count("acceptance 50%") == 2 and "all 2 prompts" in said and "per prompt: " in said
    assert "w" in out  # the fake's words, streamed
    for extra, says in ((["--k", "3"], "--k would be the servers' own settings"),
                        (["--endpoint", f"third={fast.url}"], "streams two servers")):
        code, _, err = run("compare", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"fast={fast.url}",
                           "--prompt", "x", *extra)
        assert code == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_latency_keeps_the_prompts_done_when_a_server_fails_mid_run(run, servers, tmp_path):
    """A server that breaks down after its warm-up and two prompts: the run ends in one line (exit 2) naming it,
    and the table and files cover the prompts every mode completed, marked interrupted."""
    rsp, dying = servers(), servers(per_event=2, fail_after=3)
    code, out, err = run("latency", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"dying={dying.url}",
                         "--nb-prompts", "5", "--max-new-tokens", "4")
    said = [line for line in err.strip().splitlines() if not line.startswith("[")]  # progress lines aside
    assert code == 2 and len(said) == 1 and said[0].startswith("error: --endpoint dying"), err
    assert "HTTP 500" in err and "cover the 2 prompts completed before" in err, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv")
    assert rows["interrupted"].all() and (rows["prompts"] == 2).all()
    assert len(pd.read_csv(tmp_path / "results" / "latency_prompts.csv")) == 4


def test_a_gateway_serving_several_models_and_asking_for_a_key(run, servers, monkeypatch):
    """``LABEL=URL#MODEL`` asks one gateway for one of its models; a key comes from LLAMASSP_API_KEY, never from the
    command line, and a server that wants one and gets none is said in one line."""
    gateway = servers(model="big", also=("big-eagle",), key="s3cret")
    values = [f"rsp={gateway.url}#big", f"eagle={gateway.url}/v1#big-eagle"]
    rsp, eagle = parse_endpoints(values)
    assert (rsp.url, rsp.model, eagle.url, eagle.model) == (gateway.url, "big", gateway.url, "big-eagle")
    args = [f"--endpoint={v}" for v in values]
    code, _, err = run("latency", "tiny-target", *args, "--nb-prompts", "1", "--max-new-tokens", "4")
    assert code == 2 and "HTTP 401" in err and "LLAMASSP_API_KEY" in err and len(err.strip().splitlines()) == 1, err
    monkeypatch.setenv("LLAMASSP_API_KEY", "s3cret")
    code, out, err = run("latency", "tiny-target", *args, "--nb-prompts", "2", "--max-new-tokens", "4")
    assert code == 0 and gateway.asked in ("big", "big-eagle"), err
    assert "eagle = " in " ".join(out.split()) and "model big-eagle" in " ".join(out.split())
    code, _, err = run("latency", "tiny-target", f"--endpoint=rsp={gateway.url}#big", f"--endpoint=x={gateway.url}#nope")
    assert code == 2 and "serves no model 'nope' (it lists big, big-eagle)" in err, err


def test_behind_a_gateway_the_counters_come_from_the_servers_named_by_metrics(run, servers):
    """A gateway that exports no /metrics and has no /tokenize, in front of an SSp server: ``,metrics=URL`` reads
    that server's counters (each replica's summed where several are named) and asks it to tokenize; a metrics=
    server without counters is one line; one whose counters never move is said under the table."""
    behind, idle = servers(per_event=3, model="pod/eagle"), servers(per_event=3, model="pod/eagle")
    plain = servers(model="pod/plain")
    gateway = servers(model="big", also=("big-eagle",), forward=behind)
    rsp = f"--endpoint=rsp={gateway.url}#big"
    rsp_gw, eagle = parse_endpoints([f"rsp={gateway.url}#big",
                                     f"eagle={gateway.url}#big-eagle,metrics={behind.url}/v1/,metrics={idle.url}"])
    assert eagle.metrics == (behind.url, idle.url) and eagle.model == "big-eagle" and not rsp_gw.metrics
    behind.drafts, idle.drafts = 5, 7  # replicas: their counters summed
    assert endpoint_counters(eagle).drafts == 12 and endpoint_counters(rsp_gw) is None  # the gateway exports none
    for value, said in ((f"rsp={gateway.url},metrics={behind.url}", "the rsp server has none to read"),
                        (f"eagle={gateway.url},metrics=pod:8000", "pod:8000 needs http:// or https://")):
        with pytest.raises(UserError, match=said):
            parse_endpoints([f"rsp={gateway.url}", value] if not value.startswith("rsp") else [value, "x=http://h"])
    args = ("--nb-prompts", "2", "--max-new-tokens", "9")
    code, out, err = run("latency", "tiny-target", rsp, f"--endpoint=eagle={gateway.url}#big-eagle,metrics={behind.url}",
                         *args)
    flat = " ".join(out.split())
    assert code == 0 and f"counters from {behind.url}" in flat and "never moved" not in flat, err
    ssp = next(line for line in out.splitlines() if "eagle" in line and "│" in line)
    assert "0.67" in ssp and "eagle K=3" in ssp  # two of three drafts accepted, K from the server behind's counters
    code, out, _ = run("latency", "tiny-target", rsp, f"--endpoint=eagle={gateway.url}#big-eagle,metrics={idle.url}",
                       *args)
    assert code == 0 and "never moved" in " ".join(out.split())
    code, _, err = run("latency", "tiny-target", rsp, f"--endpoint=eagle={gateway.url}#big-eagle,metrics={plain.url}")
    assert code == 2 and f"metrics={plain.url} exports no speculative-decoding counters" in err, err
    behind.tokenize = lambda text: [ord(c) + 1 for c in text]  # the server behind splits text otherwise
    code, _, err = run("latency", "tiny-target", rsp, f"--endpoint=eagle={gateway.url}#big-eagle,metrics={behind.url}")
    assert code == 2 and "does not tokenize as" in err, err


def test_drafts_said_in_the_usage_give_the_acceptance_where_no_counters_do(run, servers, tmp_path):
    """A server that says each response's drafts in its usage (OpenAI's accepted/rejected prediction tokens, as
    SGLang can) and exports no counters: acceptance per completion and per level from them, α and tokens per forward
    not known (no draft steps said); other traffic on its counters cannot move them."""
    rsp, said = servers(), servers(per_event=3, metrics=False, details=True)
    code, out, err = run("latency", "tiny-target", f"--endpoint=rsp={rsp.url}", f"--endpoint=said={said.url}",
                         "--nb-prompts", "2", "--max-new-tokens", "9", "--ignore-eos")
    assert code == 0, err
    rows = pd.read_csv(tmp_path / "results" / "latency.csv").set_index("mode")
    assert rows.loc["ssp", "acceptance_rate"] == pytest.approx(2 / 3)  # 6 of 9 drafts kept, per its usage
    assert math.isnan(rows.loc["ssp", "alpha"]) and math.isnan(rows.loc["ssp", "mean_accepted"])
    busy = servers(per_event=3, details=True, traffic=5)  # counters moved by others, usage its own
    code, out, err = run("load", "tiny-target", f"--endpoint=rsp={rsp.url}", f"--endpoint=said={said.url}",
                         f"--endpoint=busy={busy.url}", "--concurrency", "1,2", "--requests", "2",
                         "--max-new-tokens", "9", "--task", "stories")
    assert code == 0, err
    level = pd.read_csv(tmp_path / "results" / "load.csv")
    ssp = level[level["mode"] == "ssp"]
    assert (ssp["acceptance_rate"] - 2 / 3).abs().max() < 1e-9 and ssp["mean_acceptance_length"].isna().all()
    assert "other traffic" not in " ".join(out.split())


def test_a_server_that_takes_no_token_ids_gets_the_prompt_as_text(run, servers, tmp_path):
    """``,prompt=text`` (TGI, Ollama): the prompt goes as the target tokenizer's text of the ids; without it such a
    server's refusal says what to add, in one line."""
    from conftest import char_tokenizer

    rsp, texts = servers(), servers(per_event=2, takes_text=True)
    endpoint = parse_endpoints([f"rsp={rsp.url}", f"t={texts.url},metrics={texts.url},prompt=text"])[1]
    assert endpoint.text_prompt and endpoint.metrics == (texts.url,) and "prompts as text" in endpoint.describe()
    with pytest.raises(UserError, match="prompt= takes text or ids"):
        parse_endpoints([f"rsp={rsp.url}", f"t={texts.url},prompt=words"])
    args = ("--nb-prompts", "2", "--max-new-tokens", "6")
    code, _, err = run("latency", "tiny-target", f"--endpoint=rsp={rsp.url}", f"--endpoint=t={texts.url}", *args)
    assert code == 2 and "HTTP 400" in err and "add ,prompt=text to its --endpoint" in err, err
    assert [line.startswith("error:") for line in err.strip().splitlines()][-1:] == [True] and "Traceback" not in err
    code, out, err = run("latency", "tiny-target", f"--endpoint=rsp={rsp.url}", f"--endpoint=t={texts.url},prompt=text",
                         *args)
    assert code == 0, err
    sent = {p for p in texts.prompts if isinstance(p, str)}  # each the text of the ids rsp was sent
    assert len(sent) >= 2 and sent <= {char_tokenizer().decode(ids) for ids in rsp.prompts}, sent
    code, out, err = run("load", "tiny-target", f"--endpoint=rsp={rsp.url}", f"--endpoint=t={texts.url},prompt=text",
                         "--concurrency", "1", "--requests", "2", "--max-new-tokens", "6", "--task", "stories")
    assert code == 0, err


def test_the_chat_api_sends_the_conversation_for_the_servers_template(run, servers, tmp_path):
    """``,api=chat`` (a gateway with chat completions only): each turn goes as the conversation so far (the earlier
    answers as the assistant's), its streamed deltas timed as text events; every endpoint alike or none; a command
    that sends raw prompts (eval) refuses it in one line."""
    rsp, fast = servers(), servers(per_event=2)
    chat = [f"--endpoint=rsp={rsp.url},api=chat", f"--endpoint=fast={fast.url},api=chat"]
    with pytest.raises(UserError, match="every server api=chat or none"):
        parse_endpoints([f"rsp={rsp.url},api=chat", f"fast={fast.url}"])
    with pytest.raises(UserError, match="api= takes chat or completions"):
        parse_endpoints([f"rsp={rsp.url},api=chat,prompt=text", f"fast={fast.url},api=chat"])
    code, out, err = run("latency", "tiny-target", *chat, "--task", "chat", "--nb-prompts", "2",
                         "--max-new-tokens", "6")
    assert code == 0, err
    conversations = [p for p in fast.prompts if isinstance(p, list) and p and isinstance(p[0], dict)]
    assert conversations and all(m[0]["role"] == "user" for m in conversations)
    later = [m for m in conversations if len(m) > 1]  # a second turn: the first answer as the assistant's
    assert later and [m["role"] for m in later[0]] == ["user", "assistant", "user"], later
    rows = pd.read_csv(tmp_path / "results" / "latency.csv").set_index("mode")
    assert rows.loc["ssp", "acceptance_rate"] == pytest.approx(0.5) and rows.loc["ssp", "speedup"] > 1
    assert "chat API" in " ".join(out.split())
    code, out, err = run("load", "tiny-target", *chat, "--concurrency", "1", "--requests", "2",
                         "--max-new-tokens", "6", "--task", "stories")
    assert code == 0, err
    code, out, err = run("compare", "tiny-target", *chat, "--prompt", "hello", "--max-new-tokens", "6")
    assert code == 0 and "acceptance 50%" in " ".join(out.split()) and fast.prompts[-1] == [
        {"role": "user", "content": "hello"}], err
    code, _, err = run("eval", "tiny-target", *chat, "--nb-prompts", "2")
    assert code == 2 and "api=chat sends a conversation" in err and "Traceback" not in err, err


def test_counters_of_one_model_where_the_lines_name_their_model():
    from lssp.engines.vllm_server import parse_counters

    text = "\n".join([
        '# HELP vllm:spec_decode_num_drafts_total drafts',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="a"} 4.0',
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="b"} 10.0',
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="a"} 3.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="1"} 1.0',
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="a",position="0"} 2.0'])
    assert parse_counters(text).drafts == 14  # every model summed
    a = parse_counters(text, model="a")
    assert (a.drafts, a.accepted, a.accepted_per_position) == (4, 3, (2, 1))
    assert parse_counters('llamacpp:spec_decode_num_drafts_total 5', "llamacpp:", model="a").drafts == 5  # no label


def test_a_server_that_tokenizes_otherwise_than_target_is_refused_in_one_line(run, servers):
    """Prompts go as TARGET's token ids: a server whose /tokenize splits the probe text otherwise (another model's
    tokenizer) is refused before anything is timed; the same ids (with a BOS of its own) or no /tokenize pass."""
    from conftest import CHARS

    def ours(text: str) -> list[int]:
        return [3 + CHARS.index(c) for c in text]
    same, with_bos = servers(tokenize=ours), servers(tokenize=lambda text: [1, *ours(text)])
    other = servers(tokenize=lambda text: [4 + CHARS.index(c) for c in text])
    code, _, err = run("latency", "tiny-target", f"--endpoint=rsp={same.url}", f"--endpoint=b={with_bos.url}",
                       "--nb-prompts", "1", "--max-new-tokens", "2")
    assert code == 0, err
    code, _, err = run("latency", "tiny-target", f"--endpoint=rsp={same.url}", f"--endpoint=o={other.url}",
                       "--nb-prompts", "1", "--max-new-tokens", "2")
    said = [line for line in err.strip().splitlines() if not line.startswith("[")]
    assert code == 2 and len(said) == 1 and "--endpoint o (fake/model) does not tokenize as tiny-target" in err, err
    assert "differing from token 0; give the served model's tokenizer as TARGET" in err


def test_counters_moved_by_other_traffic_are_left_out_and_said(run, servers, tmp_path):
    """A server someone else loads meanwhile: its counters move more than one completion could (accepted + steps >
    tokens - 1 + K), so that completion's acceptance is left out, and the run says why; the timings stay."""
    rsp, busy = servers(), servers(per_event=2, traffic=50)
    code, out, err = run("latency", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"busy={busy.url}",
                         "--nb-prompts", "2", "--max-new-tokens", "8", "--ignore-eos")
    assert code == 0, err
    said = " ".join(out.split())
    assert "On 3 completions (warm-ups counted) a server's counters moved more than it could make alone" in said
    rows = pd.read_csv(tmp_path / "results" / "latency.csv").set_index("mode")
    assert math.isnan(rows.loc["ssp", "acceptance_rate"]) and rows.loc["ssp", "ms_per_token"] > 0


def test_load_leaves_out_a_levels_counters_that_other_traffic_moved(run, servers, tmp_path):
    rsp, busy = servers(), servers(per_event=2, traffic=50)
    code, out, err = run("load", "tiny-target", "--endpoint", f"rsp={rsp.url}", "--endpoint", f"busy={busy.url}",
                         "--concurrency", "1,2", "--requests", "3", "--max-new-tokens", "8", "--task", "stories")
    assert code == 0, err
    assert "The counters of busy at c=1, busy at c=2 moved more than the level's requests could make alone" in \
        " ".join(out.split())
    rows = pd.read_csv(tmp_path / "results" / "load.csv")
    assert rows[rows["mode"] == "ssp"]["acceptance_rate"].isna().all()

"""The server-backed engine base (core_rl_server_kit.remote) against a scripted HTTP server, for faults a real
server cannot produce on demand: error statuses, slow answers, requests interrupted mid-way. (Real
vLLM and SGLang servers are exercised by their plugins' conformance tests.)"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pytest
from core_rl.config.loader import structure
from core_rl.interfaces import SamplingParams
from core_rl.testing.recording_server import QuietHTTPServer, send_json
from core_rl_server_kit.processes import ServerError
from core_rl_server_kit.remote import (
    Completion,
    ServerOptions,
    ServerReplyError,
    ServerRolloutEngine,
    json_post,
    versions_from_spans,
)


class Script:
    """What the fake server answers: ``replies`` is consumed one per /gen request; each is a status
    code, ``"slow"`` (sleep 3 s first) or ``"abort"`` (half the tokens, finish ``abort``)."""

    def __init__(self, replies: list[Any]) -> None:
        self.replies = list(replies)
        self.requests: list[dict] = []
        self.inflight = 0
        self.max_inflight = 0
        self.lock = threading.Lock()
        self.batches: list[list[dict]] = []  # the items of each /batch request
        self.batch_replies: list[int] = []


def serve(script: Script) -> tuple[QuietHTTPServer, str]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _send(self, status: int, body: Any) -> None:
            send_json(self, status, body)

        def do_GET(self) -> None:
            self._send(200, {})

        def _batch(self, items: list[dict]) -> None:
            """Several requests in one round trip: ``script.batch_replies`` (consumed one per batch)
            may fail the whole batch; each item then takes its reply from ``script.replies``."""
            with script.lock:
                script.batches.append(items)
                whole = script.batch_replies.pop(0) if script.batch_replies else 200
            if whole != 200:
                self._send(whole, {"error": f"scripted {whole}"})
                return
            answers = []
            for index, payload in enumerate(items):
                with script.lock:
                    script.requests.append(payload)
                    reply = script.replies.pop(0) if script.replies else 200
                if reply != 200:
                    answers.append({"index": index, "status": reply})
                    continue
                tokens = [payload["prompt"][-1] + 1 + i for i in range(payload["max_new_tokens"])]
                sample = {"ids": tokens, "lps": [-0.5] * len(tokens), "finish": "length"}
                answers.append({"index": index, "status": 200, "samples": [sample] * payload["n"]})
            self._send(200, {"answers": answers[::-1]})  # in another order than asked

        def do_POST(self) -> None:
            payload = json.loads(self.rfile.read(int(self.headers["content-length"])) or b"{}")
            if self.path == "/batch":
                self._batch(payload["requests"])
                return
            with script.lock:
                script.requests.append(payload)
                reply = script.replies.pop(0) if script.replies else 200
                script.inflight += 1
                script.max_inflight = max(script.max_inflight, script.inflight)
            try:
                if reply == "slow":
                    time.sleep(3)
                    reply = 200
                if reply == "busy":
                    time.sleep(0.3)
                    reply = 200
                if isinstance(reply, int) and reply != 200:
                    self._send(reply, {"error": f"scripted {reply}"})
                    return
                want = payload["max_new_tokens"]
                count = want // 2 if reply == "abort" else want
                tokens = [payload["prompt"][-1] + 1 + i for i in range(count)]
                samples = [
                    {"ids": tokens, "lps": [-0.5] * count, "finish": "abort" if reply == "abort" else "length"}
                    for _ in range(payload["n"])
                ]
                if reply == "relabelled":  # the first two tokens by version 0, the rest by version 1
                    for sample in samples:
                        sample["spans"] = [
                            {"version": "0", "start": 0, "end": 2},
                            {"version": "1", "start": 2, "end": count},
                        ]
                self._send(200, {"samples": samples})
            finally:
                with script.lock:
                    script.inflight -= 1

    server = QuietHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


class FakeEngine(ServerRolloutEngine):
    """The smallest server-backed engine: one POST per request."""

    env_name = "fake"

    async def request(self, client: Any, url: str, prompt_ids: list[int], sampling: SamplingParams) -> list[Completion]:
        body = await json_post(
            client, url + "/gen", {"prompt": prompt_ids, "n": sampling.n, "max_new_tokens": sampling.max_new_tokens}
        )
        return [
            Completion(s["ids"], s["lps"], s["finish"], versions_from_spans(s.get("spans"), len(s["ids"])))
            for s in body["samples"]
        ]

    # the hooks these tests never reach (the engine connects to ``urls`` and never updates weights)
    def server_command(self, python: str, port: int, index: int) -> list[str]:
        raise AssertionError("not started by these tests")

    async def pause_server(self, client: Any, url: str, mode: str) -> None:
        raise AssertionError("not paused by these tests")

    resume_server = abort_all = pause_server  # type: ignore[assignment]

    async def reload_from_disk(self, client: Any, url: str, path: str, version: int) -> None:
        raise AssertionError("no weight sync in these tests")

    join_weight_group = receive_weights = reload_from_disk  # type: ignore[assignment]


class FakeBatchEngine(FakeEngine):
    """:class:`FakeEngine` that also sends requests in batches (``POST /batch``)."""

    batches_requests = True

    async def request_batch(self, client: Any, url: str, items: Any, deliver: Any) -> None:
        payload = [{"prompt": p, "n": s.n, "max_new_tokens": s.max_new_tokens} for p, s in items]
        body = await json_post(client, url + "/batch", {"requests": payload})
        for answer in body["answers"]:
            if answer["status"] != 200:
                deliver(answer["index"], ServerReplyError(f"item answered {answer['status']}", answer["status"]))
            else:
                samples = answer["samples"]
                deliver(answer["index"], [Completion(s["ids"], s["lps"], s["finish"]) for s in samples])


@pytest.fixture
def make(tmp_path: Path):
    engines, servers = [], []

    def build(replies: list[Any], engine_cls: type = FakeEngine, **options: Any) -> tuple[FakeEngine, Script]:
        script = Script(replies)
        server, url = serve(script)
        servers.append(server)
        opts = structure({"urls": [url], "retry_backoff": 0.05, **options}, ServerOptions)
        engine = engine_cls("/models/none", opts, tmp_path)
        engines.append(engine)
        return engine, script

    yield build
    for engine in engines:
        engine.close()
    for server in servers:
        server.shutdown()
        server.server_close()


def test_failed_requests_are_retried_whole(make) -> None:
    engine, script = make([503, 500])
    (samples,) = engine.generate([[1, 2, 3]], SamplingParams(n=3, max_new_tokens=4))
    assert len(script.requests) == 3  # two failures, then the answer
    assert len(samples) == 3 and all(s.response_ids == [4, 5, 6, 7] for s in samples)


def test_a_bad_request_is_not_retried(make) -> None:
    engine, script = make([400])
    with pytest.raises(ServerReplyError, match="answered 400"):
        engine.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=2))
    assert len(script.requests) == 1


def test_retries_used_up_name_the_server(make) -> None:
    engine, script = make([503] * 10, max_retries=2)
    with pytest.raises(ServerError, match=r"server fake@http://127\.0\.0\.1:\d+: a request failed 3 times"):
        engine.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=2))
    assert len(script.requests) == 3


def test_request_timeout_then_retry(make) -> None:
    engine, script = make(["slow"], request_timeout=1.0)
    start = time.monotonic()
    (samples,) = engine.generate([[1, 2]], SamplingParams(n=2, max_new_tokens=3))
    assert len(samples) == 2 and len(script.requests) == 2
    assert time.monotonic() - start < 3.0  # did not wait for the slow answer


def test_interrupted_request_continues_from_its_tokens(make) -> None:
    engine, script = make(["abort"])
    (samples,) = engine.generate([[1, 2, 3]], SamplingParams(n=2, max_new_tokens=8))
    # the first request returned 4 of 8 tokens; each sample was continued with its prompt + tokens
    assert [r["max_new_tokens"] for r in script.requests] == [8, 4, 4]
    assert script.requests[1]["prompt"] == [1, 2, 3, 4, 5, 6, 7] and script.requests[1]["n"] == 1
    for s in samples:
        assert s.response_ids == [4, 5, 6, 7, 8, 9, 10, 11] and s.finish_reason == "length"
        assert s.token_weight_versions == [0] * 8 and len(s.logprobs) == 8


def test_concurrency_is_bounded_and_every_prompt_answered(make) -> None:
    engine, script = make(["busy"] * 12, max_concurrent_requests=3)
    out = engine.generate([[1, i + 2] for i in range(12)], SamplingParams(n=2, max_new_tokens=2))
    assert [len(g) for g in out] == [2] * 12
    assert [g[0].prompt_ids for g in out] == [[1, i + 2] for i in range(12)]
    assert script.max_inflight == 3


def test_pause_wait_holds_new_requests(make) -> None:
    engine, script = make([])
    engine.pause("wait")
    _held_until_resume(engine, script)
    assert len(script.requests) == 1


def _held_until_resume(engine: FakeEngine, script: Script) -> None:
    """A request sent while ``engine`` is paused reaches no server until :meth:`resume`, then
    is answered."""
    result: dict[str, Any] = {}
    thread = threading.Thread(
        target=lambda: result.setdefault("out", engine.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=2)))
    )
    thread.start()
    time.sleep(0.5)
    assert script.requests == [] and "out" not in result
    engine.resume()
    thread.join(30)
    assert len(result["out"][0]) == 1


def test_memory_weight_sync_is_refused(make) -> None:
    engine, _ = make([])
    with pytest.raises(NotImplementedError, match="weight_sync=disk or collective"):
        engine.update_weights({}, 1)


def test_a_server_engine_missing_a_hook_fails_when_built(tmp_path: Path) -> None:
    """Every plugin hook of ServerRolloutEngine is abstract: an engine class that forgets one cannot
    be built at all (rather than failing at its first pause or weight update, mid-run)."""

    class Incomplete(ServerRolloutEngine):
        env_name = "incomplete"

        async def request(self, client: Any, url: str, prompt_ids: list[int], sampling: SamplingParams) -> list:
            return []

    opts = structure({"urls": ["http://127.0.0.1:9"]}, ServerOptions)
    with pytest.raises(TypeError, match="abstract method.*abort_all"):
        Incomplete("/models/none", opts, tmp_path)


def test_versions_from_spans() -> None:
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 5}]
    assert versions_from_spans(spans, 5) == [3, 3, 4, 4, 4]
    assert versions_from_spans(spans, 3) == [3, 3, 4]  # spans past the tokens kept are cut
    assert versions_from_spans(None, 2) is None and versions_from_spans([], 2) is None
    assert versions_from_spans([{"version": "default", "start": 0, "end": 2}], 2) is None
    assert versions_from_spans(None, 0) == []
    with pytest.raises(ValueError, match="uncovered"):
        versions_from_spans([{"version": "1", "start": 1, "end": 3}], 3)


def test_server_version_labels_are_used_only_within_what_an_update_set(make) -> None:
    """A server's per-token labels become the samples' versions only while they lie between the
    version the request started under and the newest one an update labelled the servers with: a
    server given by URL may still carry the labels of an earlier run."""
    engine, _ = make(["relabelled", "relabelled"])
    (samples,) = engine.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=4))
    assert samples[0].token_weight_versions == [0, 0, 0, 0]  # label 1 is newer than any update here
    engine._newest_label = 1  # as load_weights_from_path(path, 1) sets it before the servers load
    (samples,) = engine.generate([[1, 2]], SamplingParams(n=1, max_new_tokens=4))
    assert samples[0].token_weight_versions == [0, 0, 1, 1]
    assert samples[0].weight_version == 0 and samples[0].newest_version == 1


def test_pause_keep_of_an_engine_that_swaps_in_place_holds_requests_here(make, monkeypatch) -> None:
    """With ``swaps_in_place`` (the weight update itself freezes running requests on the server
    for the swap), pause("keep") only holds new requests at the client: no server is paused or
    resumed, and a request sent meanwhile waits for resume()."""
    calls: list[str] = []

    async def record(self: Any, client: Any, url: str, *args: Any) -> None:
        calls.append("pause" if args else "resume")

    monkeypatch.setattr(FakeEngine, "pause_server", record)
    monkeypatch.setattr(FakeEngine, "resume_server", record)
    engine, script = make([])
    engine.pause("keep")  # a plain server engine pauses its servers
    engine.resume()
    assert calls == ["pause", "resume"]
    monkeypatch.setattr(FakeEngine, "swaps_in_place", True)
    engine.pause("keep")
    assert engine.paused and not engine.server_paused
    _held_until_resume(engine, script)
    assert calls == ["pause", "resume"]


PROMPTS = [[1, i + 2] for i in range(12)]


def _answered_in_order(out: list) -> None:
    assert [len(g) for g in out] == [2] * 12
    for prompt, group in zip(PROMPTS, out):
        assert all(s.prompt_ids == prompt and s.response_ids == [prompt[-1] + 1, prompt[-1] + 2] for s in group)


def test_requests_that_arrive_together_share_one_round_trip(make) -> None:
    """An engine that can batch sends the requests of a generation batch in one HTTP request
    (``batch_window_s``), each answered with its own samples whatever order the answers come in."""
    engine, script = make([], FakeBatchEngine, batch_window_s=0.2)
    _answered_in_order(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2)))
    assert len(script.batches) == 1 and len(script.batches[0]) == 12 and len(script.requests) == 12


def test_a_batch_window_of_zero_sends_one_request_each(make) -> None:
    engine, script = make([], FakeBatchEngine, batch_window_s=0)
    _answered_in_order(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2)))
    assert script.batches == [] and len(script.requests) == 12


def test_a_failed_item_of_a_batch_is_retried_alone(make) -> None:
    """Each request of a batch keeps its own retries: the items that failed go again (in a later
    batch), the others are answered once."""
    engine, script = make([200, 503, 200, 500], FakeBatchEngine, batch_window_s=0.2)
    _answered_in_order(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2)))
    assert len(script.requests) == 14 and len(script.batches) == 2
    assert sorted(item["prompt"][-1] for item in script.batches[1]) == [3, 5]  # items 1 and 3


def test_a_failed_batch_retries_each_of_its_requests(make) -> None:
    engine, script = make([], FakeBatchEngine, batch_window_s=0.2)
    script.batch_replies = [503]
    _answered_in_order(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2)))
    assert [len(b) for b in script.batches] == [12, 12] and len(script.requests) == 12


def test_a_request_that_a_bad_item_answer_fails_is_not_retried(make) -> None:
    engine, script = make([200, 400], FakeBatchEngine, batch_window_s=0.2)
    with pytest.raises(ServerReplyError, match="item answered 400"):
        engine.generate(PROMPTS[:3], SamplingParams(n=2, max_new_tokens=2))
    assert len(script.batches) == 1


def test_an_answer_for_a_request_never_sent_fails_the_batch(make) -> None:
    """A batch answer naming a request index the batch does not have is the server's error (the
    batch's requests are retried, then the run is told which server answered so)."""

    class OffByOne(FakeBatchEngine):
        async def request_batch(self, client: Any, url: str, items: Any, deliver: Any) -> None:
            await super().request_batch(client, url, items, lambda i, r: deliver(i + 1, r))

    engine, script = make([], OffByOne, batch_window_s=0.05, max_retries=1)
    with pytest.raises(ServerError, match=r"answered request 2 of a batch of 2"):
        engine.generate(PROMPTS[:2], SamplingParams(n=1, max_new_tokens=2))
    assert len(script.batches) == 2  # the first try and one retry


def test_the_default_request_batch_sends_one_request_each(make) -> None:
    """The base ``request_batch`` (what a plugin falls back to when a server lacks its batch route)
    answers each gathered request through its own ``request``, a failed one retried alone."""

    class Gathering(FakeEngine):
        batches_requests = True

    engine, script = make([200, 503], Gathering, batch_window_s=0.2)
    _answered_in_order(engine.generate(PROMPTS, SamplingParams(n=2, max_new_tokens=2)))
    assert script.batches == [] and len(script.requests) == 13

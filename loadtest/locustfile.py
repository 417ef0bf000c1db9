"""Locust user + shape for OpenAI-compatible servers (streaming chat and completions).

    locust -f loadtest/locustfile.py --headless --host URL --lt-model NAME --lt-scenario step ...
(`python -m moe_serve.loadtest run` builds this line.) Per request it fires custom events with
request_type "METRIC" (names "ttft sNN", "itl sNN", "e2e sNN"; response_time in ms,
response_length = output tokens) so they stay apart from the HTTP rows ("chat sNN", ...).
"""

from __future__ import annotations

import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gevent  # noqa: E402
from gevent import GreenletExit  # noqa: E402
from locust import stats as locust_stats  # noqa: E402
from locust import FastHttpUser, LoadTestShape, constant, events, task  # noqa: E402

from moe_serve.loadtest.records import RecordWriter, make_record  # noqa: E402
from moe_serve.loadtest.scenarios import SCENARIOS, Options, Scenario, build  # noqa: E402
from moe_serve.loadtest.stream import StreamTimer, error_message, request_body  # noqa: E402

METRIC = "METRIC"
_state: dict = {}
_user_ids = itertools.count()


@events.init_command_line_parser.add_listener
def _add_args(parser) -> None:
    parser.add_argument("--lt-scenario", choices=SCENARIOS, default="step")
    parser.add_argument("--lt-model", default="moe-serve-tiny-mixtral")
    parser.add_argument("--lt-api-key", default="")
    parser.add_argument("--lt-max-users", type=int, default=256)
    parser.add_argument("--lt-step-seconds", type=float, default=30.0)
    parser.add_argument("--lt-max-tokens", type=int, default=128)
    parser.add_argument("--lt-prompt-words", type=int, default=128)
    parser.add_argument("--lt-seed", type=int, default=0)
    parser.add_argument("--lt-records", default="", help="JSONL file for per-request records")


def scenario_of(options) -> Scenario:
    """The scenario named by the parsed options (built once per process)."""
    if "scenario" not in _state:
        opts = Options(max_users=options.lt_max_users, step_seconds=options.lt_step_seconds,
                       max_tokens=options.lt_max_tokens, prompt_words=options.lt_prompt_words, seed=options.lt_seed)
        _state["scenario"] = build(options.lt_scenario, opts)
    return _state["scenario"]


@events.test_start.add_listener
def _open_records(environment, **_kw) -> None:
    path = environment.parsed_options.lt_records
    _state["writer"] = RecordWriter(Path(path)) if path else None


@events.quitting.add_listener
def _close_records(environment, **_kw) -> None:
    """Users have stopped: close the records, and let Locust's periodic CSV writer run once
    more (it does not write at shutdown, so the CSVs could miss the last second)."""
    if _state.get("writer"):
        _state["writer"].close()
    if environment.parsed_options.csv_prefix:
        gevent.sleep(1.5 * locust_stats.CSV_STATS_INTERVAL_SEC + 0.2)


class StepShape(LoadTestShape):
    """Follows the scenario's stages; all users of a stage start at once."""

    def tick(self):
        sc = scenario_of(self.runner.environment.parsed_options)
        t = self.get_run_time()
        if t >= sc.duration:
            return None
        users = sc.stages[sc.stage_index(t)].users
        return users, max(users, 1) * 100


class OpenAIStreamUser(FastHttpUser):
    """Closed loop: send a streamed request, read it to the end, send the next."""

    wait_time = constant(0)
    network_timeout = 600.0
    connection_timeout = 30.0

    def on_start(self) -> None:
        opts = self.environment.parsed_options
        self.scenario = scenario_of(opts)
        self.uid = next(_user_ids)
        self.rng = self.scenario.user_rng(self.uid)
        self.model = opts.lt_model
        self.headers = {"Accept": "text/event-stream"}
        if opts.lt_api_key:
            self.headers["Authorization"] = f"Bearer {opts.lt_api_key}"

    def _clock(self) -> float:
        return self.environment.shape_class.get_run_time()

    @task
    def one_request(self) -> None:
        if self.scenario.stages[self.scenario.stage_index(self._clock())].users == 0:
            gevent.sleep(0.05)  # an idle stage began; Locust's shape stops users up to 1 s late
            return
        spec = self.scenario.picker(self.rng)
        path, body = request_body(spec.endpoint, self.model, spec.prompt, spec.max_tokens)
        timer = StreamTimer(self._clock())
        stage = self.scenario.stage_index(timer.t_send)
        tag = f"s{stage:02d}"
        status = "cancelled"
        try:
            with self.client.post(path, json=body, headers=self.headers, stream=True, catch_response=True,
                                  name=f"{spec.endpoint} {tag}") as resp:
                try:
                    self._read(resp, timer)
                except GreenletExit:
                    raise
                except Exception as exc:  # noqa: BLE001 - a broken stream is a failed request
                    timer.error = f"{type(exc).__name__}: {exc}"
                timer.finish(self._clock())
                status = "error" if timer.error else "ok"
                if timer.error:
                    resp.failure(timer.error)
                else:
                    resp.success()
        finally:
            writer = _state.get("writer")
            if writer:
                writer.write(make_record(stage, self.uid, spec, timer, status))
        if status == "ok":
            self._fire(tag, timer)

    def _read(self, resp, timer: StreamTimer) -> None:
        if resp.status_code != 200:
            timer.error = error_message(resp.status_code, resp.content or b"") if resp.status_code else \
                f"connection failed: {getattr(resp, 'error', '')}"
            return
        raw = resp._response  # geventhttpclient response: readline() returns each line as it arrives
        done = False
        while True:  # read to the end of the body (after [DONE] too) so the connection can be reused
            line = raw.readline(b"\n")
            if not line:
                return
            if not done:
                done = timer.line(line, self._clock())

    def _fire(self, tag: str, timer: StreamTimer) -> None:
        fire = self.environment.events.request.fire
        for metric, value in (("ttft", timer.ttft), ("itl", timer.itl), ("e2e", timer.e2e)):
            if value is not None:
                fire(request_type=METRIC, name=f"{metric} {tag}", response_time=value * 1000.0,
                     response_length=timer.output_tokens, exception=None, context={})

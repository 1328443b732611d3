"""`infinigen serve` listens while it warms up: the port is served at once, every route answers 503 with a
Retry-After header and OpenAI's error body saying what is loading, /health turns 200 once it serves; stderr
says each step; a failure while warming up is one line (exit 2 for the user's input, 1 otherwise); SIGTERM and
SIGINT during the warm-up exit 0 and 130."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("sse_starlette")
httpx = pytest.importorskip("httpx")

from infinigen.policies import make_policy  # noqa: E402
from infinigen.serve.app import BackgroundServer, WarmingUp, create_app  # noqa: E402
from infinigen.serve.engine import Engine  # noqa: E402
from support.cli import console  # noqa: E402

NAME = "tiny"
BODY = {"model": NAME, "prompt": "the cat", "max_tokens": 3, "temperature": 0}


@pytest.fixture(scope="module")
def checkpoint_model(tiny_checkpoint):
    from infinigen.loading import load
    model, tok, _ = load(str(tiny_checkpoint), progress=False)
    return model, tok


def _loading(r: httpx.Response, phase: str) -> None:
    assert r.status_code == 503, r.text
    assert int(r.headers["retry-after"]) >= 1
    assert r.json() == {"error": {"message": f"loading: {phase}", "type": "unavailable_error", "param": None,
                                  "code": "model_loading"}}


def test_every_route_answers_503_until_the_app_is_ready(checkpoint_model):
    """The gate in front of a server that is loading: /health, /v1/models, /metrics and a completion all get
    the 503 of the current phase; once handed the app, the same routes serve (the engine started by it)."""
    model, tok = checkpoint_model
    gate = WarmingUp()
    with BackgroundServer(gate) as url:
        with httpx.Client(base_url=url, timeout=30) as c:
            for phase in ("model", "calibrating", "compiling"):
                gate.phase = phase
                _loading(c.get("/health"), phase)
                _loading(c.get("/v1/models"), phase)
                _loading(c.get("/metrics"), phase)
                _loading(c.post("/v1/completions", json=BODY), phase)
                _loading(c.post("/v1/chat/completions", json={"model": NAME, "messages": []}), phase)
            eng = Engine(model, make_policy("full"))
            gate.ready(create_app(eng, tok, NAME))
            health = c.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok"
            assert c.get("/v1/models").json()["data"][0]["id"] == NAME
            r = c.post("/v1/completions", json=BODY)
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    assert not eng._thread.is_alive()  # the server's shutdown stopped the engine


# ---- the console script -------------------------------------------------------------------------------------
class _Serve:
    """`infinigen serve` in a subprocess with a cache of its own (so the step compiles cold: a warm-up of
    seconds); its stderr lines are read by a thread as they come."""

    def __init__(self, tiny_checkpoint, tmp_path, *extra):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "INFINIGEN_CACHE": str(tmp_path / "cache")}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        argv = console("serve", "--model", tiny_checkpoint, "--served-model-name", NAME, "--port", 0, *extra)
        self.p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.p.stderr), daemon=True)
        self.reader.start()

    def wait_for(self, pattern: str, timeout: float = 600) -> re.Match:
        """The first stderr line matching `pattern` (the process must not end before it)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                m = re.search(pattern, line)
                if m:
                    return m
            if self.p.poll() is not None:
                self.reader.join(timeout=30)
                pytest.fail(f"serve exited ({self.p.returncode}) before {pattern!r}: {''.join(self.lines)}")
            time.sleep(0.02)
        pytest.fail(f"no {pattern!r} in {timeout} s: {''.join(self.lines)}")

    def finish(self, timeout: float = 600) -> tuple[int, str]:
        try:
            self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:
                self.p.kill()
                self.p.wait()
        self.reader.join(timeout=30)
        return self.p.returncode, "".join(self.lines)


def test_serve_answers_while_it_warms_up(tiny_checkpoint, tmp_path):
    """From the first log line on, /health answers: 503 "loading: ..." (with Retry-After) while the model loads,
    the policy prepares and the step compiles, then 200; the log names each step, in order, and the phases
    the 503s named came in that order too."""
    s = _Serve(tiny_checkpoint, tmp_path, "--policy", "infinigen", "--no-batch-invariant", "--compile", "on",
               "--max-batch", "2")
    try:
        url = s.wait_for(r"503 on (http://\S+) until ready").group(1)
        phases = []
        with httpx.Client(base_url=url, timeout=30) as c:
            while True:
                r = c.get("/health")
                if r.status_code == 200:
                    break
                _loading(r, r.json()["error"]["message"].removeprefix("loading: "))
                phases.append(r.json()["error"]["message"])
                assert s.p.poll() is None
                time.sleep(0.05)
            assert r.json()["status"] == "ok"
            assert c.post("/v1/completions", json=BODY).status_code == 200
        s.wait_for(r"serving \S+ on http://")
        s.p.send_signal(signal.SIGTERM)
        code, err = s.finish()
    finally:
        if s.p.poll() is None:
            s.p.kill()
    assert code == 0, err
    assert "loading: compiling" in phases  # a cold compile takes seconds: the 503s saw it
    order = ["loading: model", "loading: calibrating", "loading: compiling"]
    seen = [p for p in order if p in phases]
    assert [p for p in dict.fromkeys(phases)] == seen
    steps = [re.match(r"infinigen: loading: (\w+)", line) for line in err.splitlines()]
    assert [m.group(1) for m in steps if m] == ["model", "calibrating", "model", "compiling", "compiling"]
    assert "Traceback" not in err


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_signal_during_the_warm_up(tiny_checkpoint, tmp_path, sig, code):
    """A signal while the step compiles: exit 0 (SIGTERM) or 130 (SIGINT, "interrupted"), no traceback, the
    server never served, and the port is free again."""
    s = _Serve(tiny_checkpoint, tmp_path, "--no-batch-invariant", "--compile", "on", "--max-batch", "1")
    try:
        url = s.wait_for(r"503 on (http://\S+) until ready").group(1)
        s.wait_for(r"loading: compiling")
        s.p.send_signal(sig)
        got, err = s.finish()
    finally:
        if s.p.poll() is None:
            s.p.kill()
    assert got == code, err
    assert "Traceback" not in err and "serving" not in err
    assert ("interrupted" in err) == (sig == signal.SIGINT)
    import socket
    host, port = url[7:].split(":")
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, int(port)))


def _progress_then_error(err: str) -> str:
    """The error line of a failed warm-up; every line before it is a progress line."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert "Traceback" not in err
    assert all(line.startswith("infinigen: loading: ") for line in lines[:-1]), err
    assert lines[-1].startswith("infinigen: error: "), err
    return lines[-1]


def test_a_failure_while_warming_up_is_one_line(cli, tiny_checkpoint, monkeypatch):
    """The user's fault (a model that is not there): exit 2; anything else (a bug in a step): exit 1; one
    line either way, after the progress lines; the port is given back."""
    import infinigen.commands.serve as serve_cmd
    code, _, err = cli("serve", "--model", tiny_checkpoint.parent / "no-such-model", "--port", 0)
    assert code == 2
    assert "no-such-model" in _progress_then_error(err)

    def broken(*a, **k):
        raise RuntimeError("a step\nbroke")
    monkeypatch.setattr(serve_cmd, "prepare_policies", broken)
    code, _, err = cli("serve", "--model", tiny_checkpoint, "--port", 0, "--compile", "off")
    assert code == 1
    assert _progress_then_error(err) == "infinigen: error: warming up failed: RuntimeError: a step broke"
    assert not any(t.name == "infinigen-http" for t in threading.enumerate())  # the server's thread is gone


@pytest.mark.parametrize("sig,code", [(signal.SIGTERM, 0), (signal.SIGINT, 130)], ids=["SIGTERM", "SIGINT"])
def test_a_signal_that_a_library_turned_into_its_own_error(cli, tiny_checkpoint, monkeypatch, sig, code):
    """The exception a signal's handler raises can come out of a library as another error (the interpreter wraps
    one raised in `__set_name__` while a module imports; the loader then says the config describes no valid model):
    the exit is still the signal's (0 or 130), without that error's line."""
    from infinigen import loading
    from infinigen.errors import UserError

    def load(*a, **k):
        try:
            os.kill(os.getpid(), sig)
            time.sleep(30)
        except BaseException:
            raise UserError("config.json describes no valid model: Error calling __set_name__") from None
    monkeypatch.setattr(loading, "load", load)
    got, _, err = cli("serve", "--model", tiny_checkpoint, "--port", 0, "--compile", "off")
    assert got == code, err
    assert "error" not in err and "Traceback" not in err
    assert ("interrupted" in err) == (sig == signal.SIGINT)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_whose_exception_was_swallowed_is_raised_again(monkeypatch, sig):
    """A signal during the warm-up whose exception a library dropped (a KeyboardInterrupt raised inside a `__del__`
    is printed and ignored) is still the stop: `raise_a_swallowed_stop` (called once the warm-up returns) raises
    what the signal asked for, KeyboardInterrupt (exit 130) or SystemExit(0); with no signal, nothing."""
    from infinigen import cli
    monkeypatch.setattr(cli, "stop_native_builds", lambda: None)
    monkeypatch.setattr(cli, "_stopped_by", None)
    cli.raise_a_swallowed_stop()
    monkeypatch.setattr(cli, "_stopped_by", sig)
    with pytest.raises(KeyboardInterrupt if sig == signal.SIGINT else SystemExit) as e:
        cli.raise_a_swallowed_stop()
    assert sig == signal.SIGINT or e.value.code == 0


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stop_raised_inside_a_finalizer_prints_no_traceback(monkeypatch, capsys, sig):
    """The signal's exception raised inside a `__del__` (Python prints such an exception with a traceback and drops
    it) prints nothing while a signal stops the command; another exception there is printed as Python prints it."""
    import gc

    from infinigen import cli
    monkeypatch.setattr(cli, "stop_native_builds", lambda: None)
    monkeypatch.setattr(cli, "_stopped_by", sig)
    monkeypatch.setattr("sys.unraisablehook", cli._quiet_stop_in_finalizers)

    class Finalized:
        def __init__(self, error):
            self.error = error

        def __del__(self):
            raise self.error
    Finalized(KeyboardInterrupt() if sig == signal.SIGINT else SystemExit(0))
    gc.collect()
    assert "Traceback" not in capsys.readouterr().err
    Finalized(ValueError("a real error"))
    gc.collect()
    err = capsys.readouterr().err
    assert "Traceback" in err and "a real error" in err
